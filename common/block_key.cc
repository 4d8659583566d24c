// Block keys; see flexkv/block_key.h. (being written)
