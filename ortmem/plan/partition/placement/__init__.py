"""The placement search behind :func:`ortmem.plan.partition.device_map.infer_device_map`: ``tree`` (the
module tree), ``plans`` (``Placement``, the objective, limits), ``greedy`` and ``sequence`` (the two
heuristics), ``exact`` (branch and bound). ``device_map`` is its only user and imports the modules
themselves; nothing is re-exported here."""

__all__: list[str] = []
