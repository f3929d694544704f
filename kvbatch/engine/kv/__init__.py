"""The paged KV cache: block manager, block-table rows and their device copy, pool sizing."""
