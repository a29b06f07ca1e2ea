"""Session creation replayed through the glibc model (:mod:`.memsim`): the order ORT allocates, copies, packs and frees, giving peak and steady bytes with and without hygiene.

Part of :mod:`ortmem.plan.estimate` (see ``estimator`` for the method)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping
from ortmem.plan.estimate import shapes as shp
from ortmem.ort import graph_index as og
from ortmem.plan.estimate.memsim import MMAP_THRESHOLD_MAX, Heap
from ortmem.plan.estimate.recipe import CreatedTensor, Recipe, Weight

#: Tensors this small stay inside the protobuf: ORT does not copy them into an OrtValue
#: (``Graph::ConvertInitializersIntoOrtValues``, graph.cc).
ORT_INLINE_MAX = 127
#: The buffer ORT reads a model file through while parsing it (malloc trace, see ``simulate``).
LOAD_BUFFER_BYTES = 4 << 20


# ------------------------------------------------------------------------ creation, replayed
@dataclass
class _Sim:
    after_create_rss: int
    after_create_in_use: int
    peak_rss: int
    peak_in_use: int
    peak_at: str
    steady_rss: int
    steady_in_use: int
    in_use: dict[str, int]


def _new_initializer(h: Heap, nw: CreatedTensor, label: str):
    """A tensor an optimizer creates: computed into an ``Initializer``, serialized into a TensorProto
    (``Initializer::ToProto``, a copy) for ``Graph::AddInitializedTensor``, which converts it into an
    OrtValue (another copy); the first two are freed. Three buffers, one kept."""
    work = h.alloc(nw.nbytes, f"Initializer {nw.key[1]}")
    proto = h.alloc(nw.nbytes, f"TensorProto {nw.key[1]}")
    h.free(work)
    kept = h.alloc(nw.nbytes, label)
    h.free(proto)
    return kept


def simulate(plan: Recipe, *, dynamic: bool, all_external: bool, activation_peak: int, run_touch: int,
              prepacked: bool = False, blobs_read_at_create: bool = False) -> _Sim:
    """Replay session creation's allocations (and one run) through the glibc model.

    ``prepacked``: ORT loads the cache entry's pre-packed model (ORT's finished model, :mod:`ortmem.store.finished`): it still
    packs every MatMulNBits ``B`` on the heap, hashes the result, finds the saved blob and frees its
    copy once that kernel is done; the saved blobs (MatMulNBits ``B`` only, fp32 MatMul/Gemm packs
    stay on the heap) are not touched during creation and are read by the first run, file-backed.
    ``blobs_read_at_create``: the release compares every saved blob with its fresh packing during
    creation (``ortmodel.release`` ``prepacked_validated``, 1.32 on), so the blobs are resident file
    pages from creation on rather than from the first run."""
    h = Heap(dynamic=dynamic)
    ws = plan.weights

    def storage(w: Weight) -> str:
        return "external" if all_external and w.storage == "embedded" else w.storage

    # A: parse (embedded bytes into the protobuf), then copy each into an OrtValue, freeing the proto copy
    # A subgraph's initializers live inside its parent node's attribute: ``Graph::AddNode`` copies the
    # NodeProto's attributes into the Node (``Node::AddAttributeProto``, graph.cc) and
    # ``Node::CreateSubgraph`` builds the subgraph on that copy, while the ModelProto keeps the original
    # node; neither copy's bytes are released (measured: a 4 MiB fp32 weight local to a Loop body,
    # embedded, leaves 8 MiB more in use after creation than the same weight in the main graph).
    emb = [w for w in ws.values() if storage(w) == "embedded" and w.nbytes > ORT_INLINE_MAX]
    # The load reads the file through a 4 MiB buffer that is freed once the ModelProto is parsed
    # (malloc trace of ORT 1.31.1 creating a session on an embedded 20 MB and 134 MB model: one
    # 4,194,304-byte block before the tensors' raw_data strings, freed right after them). Being the
    # first large mmapped block freed, it lifts glibc's mmap threshold to 4 MiB before the OrtValue
    # copies are made: from then on every block under 4 MiB lives in the heap.
    read_buf = h.alloc(min(LOAD_BUFFER_BYTES, sum(w.nbytes for w in emb)), "model file read buffer") if emb else None
    protos = [h.alloc(w.nbytes, "protobuf parse") for w in emb]
    h.free(read_buf)
    attr_copies = [h.alloc(w.nbytes, f"subgraph attribute copy of {w.key[1]}") for w in emb if w.key[0]]
    held: dict[tuple[str, str], Any] = {}
    for w, blk in zip(emb, protos):
        held[w.key] = h.alloc(w.nbytes, f"OrtValue copy of {w.key[1]}")
        if not w.key[0]:
            h.free(blk)
    mapped: dict[tuple[str, str], Any] = {}

    def source_block(key: tuple[str, str], nbytes: int, label: str):
        """Memory of a source being read: its heap OrtValue, or its file pages mapped in."""
        if key in held:
            return held[key], False
        if key in mapped:
            return mapped[key], False
        w = ws.get(key)
        if w is not None and storage(w) == "inline":
            return None, False
        return h.map_file(nbytes, label), True

    def drop(key: tuple[str, str]) -> None:
        h.free(held.pop(key, None))
        h.free(mapped.pop(key, None))

    # B1: constant folding (``ConstantFolding::ApplyImpl``, optimizer/constant_folding.cc): each node runs
    # in an ``OptimizerExecutionFrame`` whose inputs are copied out of the initializers held in memory
    # (embedded ones, earlier folds' outputs) and read in place through the mapping of external ones;
    # the kernel's output OrtValue becomes the new initializer as it is (``TensorToTensorProto(...,
    # use_tensor_buffer=true)`` + ``AddInitializedOrtValue``): one buffer, kept; the copies go with the
    # frame. Measured on ORT 1.32 with a 109 MiB W (creation peak above the baseline, in W's): Gather of
    # Transpose(W) 2.1 external, 3.1 embedded; of Transpose(Cast(W fp16)) 3.1 external, 3.6 embedded.
    new_blocks: dict[tuple[str, str], Any] = {}
    for nw in plan.folds:
        frame = []
        for s in nw.sources:
            w = ws.get(s)
            if s in held or s in new_blocks:
                frame.append(h.alloc(w.nbytes if w is not None else new_blocks[s].size, f"folding copy of {s[1]}"))
            elif w is not None and s not in mapped and storage(w) == "external":
                frame.append(h.map_file(w.nbytes, f"folding reads {s[1]}"))
        new_blocks[nw.key] = h.alloc(nw.nbytes, f"folded {nw.key[1]}")
        for b in frame:
            h.free(b)
    for k in [nw.key for nw in plan.folds if nw.by == "fold-transient"]:
        h.free(new_blocks.pop(k, None))
    for w in ws.values():
        if w.dropped_by == "fold":
            drop(w.key)
    # B2: DQ+MatMul fusion (copies of weight/scale/zp, transposed tensors kept, originals dropped at Resolve)
    if not all_external:
        for b_new, s_new, z_new, srcs in plan.qdq:
            outs = [nw for nw in (b_new, s_new, z_new) if nw is not None]
            copies = [h.alloc(ws[s].nbytes, "DQ fusion Initializer copy") for s in srcs]
            for nw in outs:
                new_blocks[nw.key] = _new_initializer(h, nw, f"fused {nw.key[1]}")
            for c in copies:
                h.free(c)
        for w in ws.values():
            if w.dropped_by == "qdq":
                drop(w.key)
    # B3: NCHWc reorder, Conv by Conv (``NchwcTransformerImpl::TransformConv``): ``Initializer
    # conv_W`` copies the filter, ``std::vector<float> reordered_filter`` receives the reordered one,
    # its bytes are set into a TensorProto's raw_data and ``AddInitializerWithOrtValue`` copies them
    # into the kept OrtValue; leaving the scope frees the proto, the vector and the copy, in that
    # order. Malloc trace of ORT 1.31.1 on the conv net: per filter ``a W, a W', a W'+1, a W'`` then
    # ``f W'+1, f W', f W``; the original filters are freed after the last Conv.
    for nw in plan.nchwc:
        copy = h.alloc(sum(ws[s].nbytes for s in nw.sources), "NCHWc Initializer copy")
        work = h.alloc(nw.nbytes, f"reordered filter {nw.key[1]}")
        proto = h.alloc(nw.nbytes + 1, f"TensorProto {nw.key[1]}")
        new_blocks[nw.key] = h.alloc(nw.nbytes, f"reordered {nw.key[1]}")
        for b in (proto, work, copy):
            h.free(b)
    for w in ws.values():
        if w.dropped_by == "nchwc":
            drop(w.key)

    # C: kernels pre-pack their constant inputs node by node (index order, main graph first); a
    # source is dropped once every use of it was packed; inputs a packing kernel reads but keeps
    # (MatMulNBits scales and zero points at accuracy level 4) stay mapped
    packed_total = 0
    by_node: dict[int, list[tuple[Any, int]]] = {}
    for w in ws.values():
        if w.packs and not w.dropped_by:
            for node, pb in w.packs:
                by_node.setdefault(id(node), []).append((w, pb))
    for nw in plan.new:
        if nw.packs and (all_external or nw.key in new_blocks):
            for node, pb in nw.packs:
                by_node.setdefault(id(node), []).append((nw, pb))
    reads: dict[int, list[Any]] = {}
    for w in ws.values():
        if w.read_at_create and not w.dropped_by:
            for _, node, _ in w.uses:
                reads.setdefault(id(node), []).append(w)
    for nw in plan.new:
        if nw.read_at_create:
            for node, _ in plan.qdq_users.get(nw.key, []):
                reads.setdefault(id(node), []).append(nw)
    done: dict[tuple[str, str], int] = {}
    live_src: dict[tuple[str, str], Any] = {}
    saved = 0  # pre-packed blobs ORT maps from prepacked.bin instead of keeping its heap copy
    for node in plan.kernel_order:
        items = by_node.get(id(node), [])
        hashed = []
        for obj, pb in items:
            if obj.key not in live_src:
                if obj.key in new_blocks:
                    live_src[obj.key] = new_blocks[obj.key]
                elif isinstance(obj, CreatedTensor):  # ortmem: converted tensors are mapped files
                    live_src[obj.key] = h.map_file(obj.nbytes, f"mapped {obj.key[1]}")
                else:
                    live_src[obj.key], _ = source_block(obj.key, obj.nbytes, f"mapped {obj.key[1]}")
            blk = h.alloc(pb, f"pre-packed {obj.key[1]}")
            if prepacked and (node.op_type == "MatMulNBits" or id(node) in plan.fused):
                hashed.append(blk)
                saved += pb
                if blobs_read_at_create:
                    h.map_file(pb, f"saved blob of {obj.key[1]} compared")
            else:
                packed_total += pb
        for obj in reads.get(id(node), []):
            if obj.key in held or obj.key in mapped or obj.key in new_blocks:
                continue
            if isinstance(obj, Weight) and storage(obj) != "external":
                continue
            mapped[obj.key] = h.map_file(obj.nbytes, f"read {obj.key[1]}")
        for blk in hashed:  # the hash matched a saved blob: the kernel uses the mapping instead
            h.free(blk)
        for obj, _ in items:
            done[obj.key] = done.get(obj.key, 0) + 1
            if done[obj.key] < len(obj.packs):
                continue
            src = live_src.pop(obj.key, None)
            # an embedded weight a subgraph reads from the outer scope is dropped like any other once
            # packed (measured: same in-use as the weight in the main graph); an external one stays mapped
            keep = isinstance(obj, Weight) and ((obj.outer_use and storage(obj) != "embedded")
                                            or len(obj.packs) < obj.kept_uses)
            if keep:
                if src is not None and obj.key not in held:
                    mapped[obj.key] = src
                continue
            if isinstance(obj, CreatedTensor):
                h.free(new_blocks.pop(obj.key, None) if obj.key in new_blocks else src)
            else:
                if src is not None and src.kind == "file":
                    h.free(src)
                drop(obj.key)
    after_rss, after_in_use = h.rss, h.in_use_total
    peak_rss, peak_at, peak_in_use = h.peak_rss, h.peak_label, h.peak_in_use
    if not dynamic:
        h.trim()  # hygiene's malloc_trim(0) after creation
        after_rss = h.rss
    # one run: external weights (and saved pre-packed blobs) read for the first time, the arena's activations
    h.map_file(run_touch + (0 if blobs_read_at_create else saved), "first run reads mapped weights")
    h.alloc(activation_peak, "activations")
    steady_rss, steady_in_use = h.rss, h.in_use_total
    in_use = {
        "packed_weights": packed_total,
        "heap_weights": sum(b.size for b in held.values()) + sum(b.size for b in new_blocks.values()),
        "subgraph_proto_copies": sum(b.size for b in attr_copies) + sum(w.nbytes for w in emb if w.key[0]),
        "mapped_weights_read": sum(b.size for b in mapped.values()) + run_touch,
        "mapped_prepacked_weights": saved,
        "activations": activation_peak,
    }
    return _Sim(after_rss, after_in_use, peak_rss, peak_in_use, peak_at, steady_rss, steady_in_use, in_use)


def retention_basis(plan: Recipe, all_external: bool) -> int:
    """Bytes whose release glibc keeps beyond the heap model (calibrated by ``retention_fraction``):
    the sources ORT's DQ fusion copies and drops, and embedded originals dropped after folding,
    fusion, NCHWc or pre-packing. ortmem's path has neither (converted ahead, nothing embedded).
    A tensor above glibc's largest mmap threshold (``MMAP_THRESHOLD_MAX``) always has a mapping of
    its own, unmapped when freed: nothing of it stays (a tied embedding's 109 MiB LM head, dropped
    once packed, leaves 14 MiB more resident embedded than external, all of it the small tensors)."""
    if all_external:
        return 0
    fused = {s for _, _, _, srcs in plan.qdq for s in srcs}
    total = sum(plan.weights[s].nbytes for s in fused if plan.weights[s].nbytes <= MMAP_THRESHOLD_MAX)
    for w in plan.weights.values():
        if (w.key in fused or w.storage != "embedded" or w.nbytes <= ORT_INLINE_MAX
                or w.nbytes > MMAP_THRESHOLD_MAX):
            continue
        if w.dropped_by or (w.packs and len(w.packs) == w.kept_uses):  # embedded: outer-scope ones too
            total += w.nbytes
    return total


def run_touch(plan: Recipe, shapes: shp.Shapes, root: og.OrtGraph, all_external: bool,
              gathered: Mapping[tuple[str, str], list[tuple[og.OrtGraph, og.OrtNode]]] | None = None) -> int:
    """Bytes of external weights a run reads that creation did not: kept (not packed away) tensors,
    whole, except Gather tables, of which only the gathered rows are read. ``gathered``: tables (and
    their scales and zero points) that a GatherBlockQuantized reads row by row on ortmem's side
    (:func:`~ortmem.plan.estimate.recipe.ortmem_gathers`) where plain ORT dequantizes them whole."""
    gathered = gathered or {}
    total = 0
    for w in plan.weights.values():
        ext = w.storage == "external" or (all_external and w.storage == "embedded")
        if not ext or w.dropped_by or w.read_at_create or (w.packs and not w.outer_use and len(w.packs) == w.kept_uses):
            continue
        if w.packs and w.outer_use:
            continue  # read during packing, counted as mapped at creation
        gathers = gathered.get(w.key) or [(g, n) for g, n, slot in w.uses if n.op_type == "Gather" and slot == 0]
        if gathers and (w.key in gathered or len(gathers) == w.kept_uses) and w.dims:
            rows = 0
            for g, n in gathers:
                idx = shapes.get(g, n.inputs[1]) if len(n.inputs) > 1 else None
                rows += math.prod(idx.dims) if idx is not None and idx.known else w.dims[0]  # type: ignore[arg-type]
            row_bytes = w.nbytes // max(w.dims[0], 1)
            total += min(w.nbytes, rows * -(-max(row_bytes, 1) // 4096) * 4096)
        else:
            total += w.nbytes
    return total


