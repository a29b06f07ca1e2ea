"""The store's folder format: the one place its file names are defined.

A converted entry ``<root>/<key>/`` holds ``model.onnx`` (a skeleton whose large tensors are external
data), ``weights.bin`` (every converted weight, page-aligned), hard links to unchanged source files
(``source-<i>.<ext>``) and ``manifest.json`` (what the entry claims, checked before use); once packed,
also ``model.prepacked.onnx``, ``prepacked.bin`` and ``prepacked.json`` (:mod:`ortmem.store.prepacked`).
A prepared entry holds ``model.onnx``, ``model.data`` and ``model.json`` under the same manifest
(:mod:`ortmem.store.prepared_entries`). ``ortmem convert`` writes the same ``model.onnx`` +
``weights.bin`` pair into a folder of the user's. Names starting with "." are a writer's temporaries,
which no reader opens.
"""
from __future__ import annotations

#: What an entry claims (format, key, files, digests, sources), written last when it is published.
MANIFEST = "manifest.json"
#: The model ORT loads by path.
MODEL_FILE = "model.onnx"
#: Every converted weight, page-aligned, so ORT maps each tensor straight from the page cache.
WEIGHTS_FILE = "weights.bin"
#: Prefix of files an entry links from the model's own folder (another owner's, checked by identity).
SOURCE_LINK_PREFIX = "source-"
#: A folder being built at the cache root (renamed into place when published).
TMP_PREFIX = ".tmp-"
#: A discarded entry renamed away before it is deleted (a reader never sees it half removed).
TRASH_PREFIX = ".trash-"
#: A converted entry's model whose MatMulNBits ``B`` point into :data:`PREPACKED_DATA`.
PREPACKED_MODEL = "model.prepacked.onnx"
#: Page-aligned copies of every packed ``B``, then ORT's packed blobs.
PREPACKED_DATA = "prepacked.bin"
#: What the pre-packed files are valid for and their digests; written last, so it vouches for the rest.
PREPACKED_MANIFEST = "prepacked.json"
