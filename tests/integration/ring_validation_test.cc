// Malformed ring descriptors. (being written)
