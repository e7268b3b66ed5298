"""Images in: the vision tower in core, image prompts prefilled through the split."""
