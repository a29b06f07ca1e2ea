"""The ways users reach ortmem without changing their code much: the process-wide hook and `python -m ortmem
run`, the HTTP server, the in-process pipeline of partitioned stages, onnxruntime-genai folders."""
