"""The engine's front: LLM, the engine loop, configs, sequences, outputs, sampling params."""
