"""The engine role: HTTP servers that speak SGLang's native API. `torch_engine` is the built-in
engine (an HF model, CPU or GPU); `sglang_engine` supervises a real SGLang server in its place."""
