//! Integration tests of corral-raft: the raft-log log store (`log_store`), the persisted
//! encoding: hostile bytes (`fuzz`) and the golden bytes every later build must read and write
//! the same (`golden`), and the golden bytes of the Raft wire (`wire_golden`).

mod fuzz;
mod golden;
mod log_store;
mod wire_golden;
