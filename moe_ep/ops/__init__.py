"""EPBuffer and its two calls: its memory, dispatch, combine, what they share, their result."""
