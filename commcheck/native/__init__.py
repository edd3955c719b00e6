"""The one-pass C kernel (``kernel.c``) and its loader, used by the rank side and the
gradient probe."""
