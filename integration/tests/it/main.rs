//! Multi-process tests: each spawns the real `corral` binary (`corral dev` pools) and drives it
//! through the CLI, as users and operators do.

mod bad_input;
mod billing;
mod cluster;
mod isolation;
mod job_path;
mod security;
mod tso;
mod worker;
