"""Models shipped with hookloop: a small GPT and a Hugging Face causal LM recipe."""
