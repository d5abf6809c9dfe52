//! Integration tests of corral-core through its public API only.

mod array_bounds;
mod no_overcommit;
mod steps;
