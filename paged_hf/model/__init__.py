"""The model side: can this model run; switching it to paged attention and back."""
