"""Built-in tasks: ``regression`` (fast, for tests) and ``charlm`` (the demo's character-level LM)."""
