// PrefixIndex; see prefix_index.h. (being written)
