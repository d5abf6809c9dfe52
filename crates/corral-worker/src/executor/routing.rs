//! Routing: jobs with an image go to a container executor, the others to a process executor.

use std::sync::Arc;

use super::{ExecError, Executor, LaunchSpec, RunningJob};

/// Sends jobs with an image to a container executor and the others to a process executor.
pub struct RoutingExecutor {
    process: Arc<dyn Executor>,
    container: Arc<dyn Executor>,
}

impl RoutingExecutor {
    pub fn new(process: Arc<dyn Executor>, container: Arc<dyn Executor>) -> Self {
        RoutingExecutor { process, container }
    }
}

impl Executor for RoutingExecutor {
    fn launch(&self, spec: &LaunchSpec) -> Result<RunningJob, ExecError> {
        match spec.image {
            Some(_) => self.container.launch(spec),
            None => self.process.launch(spec),
        }
    }

    /// Containers first: their runtime state goes with them.
    fn reap_leftovers(&self) -> Result<Vec<String>, ExecError> {
        let mut reaped = self.container.reap_leftovers()?;
        reaped.extend(self.process.reap_leftovers()?);
        Ok(reaped)
    }
}
