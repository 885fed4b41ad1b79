"""The engine protocol: the contract between the rollout driver, the trainer's weight push and the
engines (the built-in torch engine and SGLang servers).

- `requests`: the request bodies of SGLang's native HTTP API that relax_hpc uses, mirroring
  SGLang 0.5.23's own request classes (checked against them by tests/unit/test_sglang_contract.py);
- `client`: the one HTTP client of an engine, plain or pipelined, with status codes mapped to
  errors in one place;
- `registry`: RUN_DIR/registry/engines, where engines announce themselves.
- `vllm`: vLLM 0.32's token-in, token-out generation and RL routes, the bodies relax_hpc sends
  and the answers it reads (checked against vLLM's classes by tests/unit/test_vllm_contract.py).

It imports no role: the driver, the trainer and the engines all import it.
"""
