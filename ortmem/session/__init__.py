"""Hand a model to ONNX Runtime so that ORT never copies its weights.

ORT memory-maps external data per tensor and drops each mapping once the kernel has pre-packed it,
but it *copies* embedded ``raw_data`` (protobuf, then an OrtValue). So every way into ORT ends as a
skeleton whose large tensors are external data (docs/handoff.md):

- a path whose file has nothing embedded and was not rewritten: given to ORT unchanged;
- a path the store has an answer for (a converted or finished entry, :mod:`ortmem.store.verdict`):
  that entry's model, by path;
- an embedded (or rewritten) model: the skeleton (kilobytes) in a private temporary folder beside
  hard links to the files its tensors point into, loaded by path (:mod:`.unconverted`); where no hard
  link can be made, the skeleton as bytes with the folder config entry instead;
- a model ortmem converts (:mod:`ortmem.session.cold_start`): a new cache entry, or converted weights ORT borrows
  from memory, or a private temporary folder;
- bytes or an ``onnx.ModelProto``: written once to a private temporary file first.

The modules, in the order a start meets them: :mod:`.request` (what the caller asked, a frozen
``Request``, everything asked of ORT asked once), :mod:`ortmem.session.decide` (the one entry point: asks the store,
converts on a miss), :mod:`.handoff` (what ORT
is given and what ortmem decided, read-only; recompute and the pre-packed retry are steps that return
a new handoff). A warm start never imports the conversion (:mod:`ortmem.session.cold_start`, :mod:`.unconverted`
and the passes).
"""
