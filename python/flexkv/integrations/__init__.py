"""Engine integrations of flexkv: the adapters that plug flexkvd into an inference engine (docs/integrations.md)."""
