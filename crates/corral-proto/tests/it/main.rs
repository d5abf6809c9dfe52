//! Integration tests of the persisted encoding: hostile bytes (`fuzz`) and the golden bytes
//! every later build must read and write the same (`golden`).

mod fuzz;
mod golden;
