//! Integration tests of corral-raft: the raft-log log store (`log_store`), and the persisted
//! encoding: hostile bytes (`fuzz`) and the golden bytes every later build must read and write
//! the same (`golden`).

mod fuzz;
mod golden;
mod log_store;
