"""What tests and benchmarks share, so each thing is written once.

* :mod:`tests.support.builders`: small hand-built models, one per way of storing weights, and the
  tiny synthetic decoder written to a folder.
* :mod:`tests.support.dq_graphs`: DQ+MatMul and DQ+Gather graphs with the knobs the matchers read.
* :mod:`tests.support.planner_graphs`: small graphs whose liveness is worked out by hand.
* :mod:`tests.support.bert`: all-MiniLM-L6-v2 built from its safetensors (the real-weights tests).
* :mod:`tests.support.genai_folder`: an onnxruntime-genai decoder folder.
* :mod:`tests.support.recompute_models`, :mod:`tests.support.fuzz_models`: the recompute planner's
  models and the mutation fuzzer.
* :mod:`tests.support.reference`: the original model run by plain ORT, the expected outputs.
* :mod:`tests.support.compare`: the one way outputs are compared.
* :mod:`tests.support.threads`: the same call from several threads at once.
* :mod:`tests.support.release_expect`: what the installed ORT release does.
* :mod:`tests.support.paths`: the repository root, wherever a test file sits.

Nothing here imports a test file, so ``bench/`` can use it too.
"""
