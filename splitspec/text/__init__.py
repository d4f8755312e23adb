"""Text in and out of token ids: tokenizers from model files, chat templates, UTF-8-safe streaming."""
