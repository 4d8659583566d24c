// Block keys: test vectors. (being written)
