// Data plane end to end. (being written)
