// PrefixIndex against a reference model. (being written)
