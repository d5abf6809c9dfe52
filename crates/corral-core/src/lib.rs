//! Pure, deterministic replicated state of corral: `State::apply(Request) -> Response` and
//! placement (`place(&State, ...) -> Vec<Placement>`).
//!
//! Boundary: no I/O, no clock, no randomness, no HashMap iteration. Time enters only through the
//! TSO timestamp that the leader stamps into each `Request`.
//! Invariant: applying the same sequence of requests to two `State`s gives identical states.

mod apply;
mod command;
mod config;
mod place;
mod state;

pub use apply::Touched;
pub use command::{ApplyError, Command, Outcome, Request, Response, FORMAT_VERSION};
pub use config::{ClusterConfig, PriorityClass};
pub use place::{place, Placement};
pub use state::{CoordinatorRecord, State};
