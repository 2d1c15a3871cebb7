"""Generation: the one generation core every caller shares, and speculative decoding."""
