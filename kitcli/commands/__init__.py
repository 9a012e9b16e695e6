"""Every `kit` command (Click), and nothing else: the top of the house. May import any layer below."""
