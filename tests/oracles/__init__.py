"""Test-only oracles, kept out of the wheel: tiny Gemma 4 checkpoints and assistants made by transformers and
converted by llama.cpp's own converter (`gemma4_fixtures`, `gemma4_assistant`), and the converter itself
(`llama_cpp`). Tests import them as `oracles.*` (tests/conftest.py puts this folder's parent on sys.path)."""
