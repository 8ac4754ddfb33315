"""What a spec may reach: the path rule for its files, secret references, their resolution and the scrubbing of resolved secrets out of every text."""
