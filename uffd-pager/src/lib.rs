//! uffd-pager: KV chunk slots in userfaultfd-managed memory under a hard resident-byte budget.
