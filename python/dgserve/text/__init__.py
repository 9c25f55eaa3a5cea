"""Text: the tokenizer, chat templates and bounded token counts."""
