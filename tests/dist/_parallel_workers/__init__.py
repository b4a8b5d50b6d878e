"""torchrun entry scripts and shared set-up for the multi-process tests of ``recover.parallel``."""
