//! Integration tests of corral-core through its public API only.

mod no_overcommit;
mod steps;
