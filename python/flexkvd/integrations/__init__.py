"""Engine integrations of flexkv: flexkvd.integrations.vllm (a vLLM V1 KV connector) and flexkvd.integrations.sglang.

Importing this package imports no engine; each module imports its engine only when its engine-facing class is
requested, and keeps its logic in plain classes that work without the engine (docs/integrations.md).
"""
