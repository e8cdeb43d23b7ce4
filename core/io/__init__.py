"""What Outrider reads: GGUF files, their tokenizers and chat templates."""
