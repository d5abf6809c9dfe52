//! Multi-process tests: each spawns the real `corral` binary (`corral dev` pools) and drives it
//! through the CLI, as users and operators do. `prometheus_config` checks the monitoring files
//! of cluster-configs/ (Prometheus rules and their tests, the Grafana dashboard) with promtool.

mod alloc;
mod attach;
mod autoscale;
mod backpressure;
mod bad_input;
mod billing;
mod boundaries;
mod bounds;
mod cluster;
mod corpus;
mod dev_cleanup;
mod dev_nodes;
mod failures_say_why;
mod gang;
mod gpu_faults;
mod grpc_services;
mod history;
mod idle;
mod images;
mod isolation;
mod job_control;
mod job_path;
mod join;
mod leases;
mod lifecycle;
mod metrics;
mod nodes;
mod paging;
mod policy;
mod prometheus_config;
mod python;
mod readme;
mod security;
mod slurm;
mod srun;
mod tso;
mod watch;
mod web;
mod worker;
