//! Pure policy decisions of llms: information density, bit-width assignment, the LCTRU queue, AoT write-out and the swapping-recompute planner. No I/O.
