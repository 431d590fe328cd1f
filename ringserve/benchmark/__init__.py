"""`ringserve bench`: a load generator for any OpenAI-compatible server
(ringserve, vLLM, sglang, llama.cpp's server), with the flags and the report
of `vllm bench serve`: requests from a dataset (`datasets.py`) sent at a
Poisson rate under a concurrency cap, each streamed and timed
(`request.py`), and the figures a serving comparison quotes
(`results.py`). `serve.py` is the command."""
