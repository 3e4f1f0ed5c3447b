"""Process and machine helpers: process lifetimes and signals (``procs``), the GPU check suite (``gpu_suite``)."""
