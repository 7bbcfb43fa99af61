"""Memory: one aligned buffer with typed views (arena) and lifetimes -> offsets (planner)."""
