//! Job arrays with the largest legal input: the largest array with the largest script,
//! environment and command and the largest window applies in memory that grows by a small
//! record per task, the same whatever the size of what the tasks share; lookups and cancels of
//! its tasks, created or not, and an index set of the most ranges, stay within their bounds.
//!
//! Memory is measured by counting what this thread allocates (a counting global allocator),
//! not by timing anything.

use corral_core::{ClusterConfig, Command, JobUpdate, Outcome, Request, State};
use corral_types::{
    ArrayRange, ArraySpec, JobId, JobSpec, JobState, Timestamp, MAX_ARGS, MAX_ARRAY_RANGES, MAX_ARRAY_TASKS,
    MAX_ARRAY_WINDOW, MAX_COMMAND_BYTES, MAX_ENV_BYTES, MAX_ENV_VARS, MAX_SCRIPT_BYTES,
};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;

/// The system allocator, counting the bytes each thread holds (allocated minus freed).
struct Counting;

thread_local! {
    static HELD: Cell<i64> = const { Cell::new(0) };
}

fn count(bytes: i64) {
    // `try_with`: a thread being torn down has no counter left; its bytes do not matter.
    let _ = HELD.try_with(|held| held.set(held.get() + bytes));
}

// SAFETY: every call is forwarded to `System` as it is; the counting touches no memory of it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as i64);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as i64));
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size as i64 - layout.size() as i64);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bytes this thread allocated and still holds after `f`, with `f`'s result.
fn growth<T>(f: impl FnOnce() -> T) -> (i64, T) {
    let before = HELD.with(Cell::get);
    let out = f();
    (HELD.with(Cell::get) - before, out)
}

fn at(ms: u64, command: Command) -> Request {
    Request { ts: Timestamp::compose(ms, 0), command }
}

fn configured() -> State {
    let mut state = State::default();
    state.apply(&at(1, Command::Configure(ClusterConfig::dev_defaults()))).expect("configure");
    state
}

/// A spec whose script, environment and command are each as large as allowed.
fn largest_spec() -> JobSpec {
    let value = "v".repeat(MAX_ENV_BYTES / MAX_ENV_VARS - 8);
    let env: BTreeMap<String, String> = (0..MAX_ENV_VARS).map(|i| (format!("V{i:05}"), value.clone())).collect();
    let arg = "a".repeat(MAX_COMMAND_BYTES / MAX_ARGS);
    let spec = JobSpec {
        tenant: "default".into(),
        command: vec![arg; MAX_ARGS].into(),
        env: env.into(),
        script: Some("#".repeat(MAX_SCRIPT_BYTES).into()),
        ..JobSpec::default()
    };
    spec.validate().expect("the largest legal spec is valid");
    spec
}

fn small_spec() -> JobSpec {
    JobSpec {
        tenant: "default".into(),
        command: vec!["true".into()].into(),
        script: Some("#!/bin/sh\n".into()),
        ..JobSpec::default()
    }
}

fn submit(state: &mut State, ms: u64, mut spec: JobSpec, array: ArraySpec) -> JobId {
    spec.array = Some(array);
    let request = at(ms, Command::SubmitJob { request_id: format!("r{ms}"), spec });
    match state.apply(&request) {
        Ok(Outcome::JobSubmitted { job_id, .. }) => job_id,
        other => panic!("submit: {other:?}"),
    }
}

fn largest_array() -> ArraySpec {
    ArraySpec {
        ranges: vec![ArrayRange { first: 0, last: MAX_ARRAY_TASKS - 1, step: 1 }],
        max_running: Some(MAX_ARRAY_WINDOW),
    }
}

/// The largest array with the largest spec and window creates its window of tasks, each a
/// small record: the state grows by about as much as with a spec of a few bytes.
#[test]
fn the_largest_array_applies_in_memory_of_a_small_record_per_task() {
    let (large, small) = (largest_spec(), small_spec());
    let shared = MAX_SCRIPT_BYTES + MAX_ENV_BYTES + MAX_COMMAND_BYTES;
    let mut state = configured();
    let (grown_large, array) = growth(|| submit(&mut state, 10, large.clone(), largest_array()));
    assert_eq!(state.array_live_tasks(array), MAX_ARRAY_WINDOW, "the window's worth of tasks");
    let mut other = configured();
    let (grown_small, _) = growth(|| submit(&mut other, 10, small.clone(), largest_array()));
    let per_task = grown_large / i64::from(MAX_ARRAY_WINDOW);
    let per_small_task = grown_small / i64::from(MAX_ARRAY_WINDOW);
    println!(
        "array of {MAX_ARRAY_TASKS} tasks, window {MAX_ARRAY_WINDOW}: state grew {grown_large} bytes with a spec \
         sharing {shared} bytes ({per_task} per task), {grown_small} bytes with a small one ({per_small_task} per task)"
    );
    assert!(per_task < 4096, "{per_task} bytes per task");
    assert!(
        (grown_large - grown_small).abs() < 64 << 10,
        "what the tasks share is held once: {grown_large} against {grown_small} bytes"
    );
    // Every task shares the array's script, environment and command.
    let array_spec = &state.jobs[&array].spec;
    for task in state.array_tasks(array) {
        let spec = &state.jobs[&task].spec;
        assert!(std::sync::Arc::ptr_eq(spec.script.as_ref().unwrap(), array_spec.script.as_ref().unwrap()));
        assert!(std::sync::Arc::ptr_eq(&spec.env, &array_spec.env));
        assert!(std::sync::Arc::ptr_eq(&spec.command, &array_spec.command));
    }
    // The array's tasks not created yet count as pending jobs of its tenant.
    assert_eq!(state.pending_count_of("default"), u64::from(MAX_ARRAY_TASKS));
    // An update of the array and its pending tasks keeps them sharing one copy.
    let update = JobUpdate { name: Some("renamed".into()), ..JobUpdate::default() };
    let (grown, _) =
        growth(|| state.apply(&at(20, Command::UpdateJob { job_id: array, update, admin: true })).expect("update"));
    println!("renaming it and its {MAX_ARRAY_WINDOW} tasks: state grew {grown} bytes");
    assert!(grown < i64::from(MAX_ARRAY_WINDOW) * 1024, "{grown} bytes");
    let array_spec = &state.jobs[&array].spec;
    for task in state.array_tasks(array) {
        let spec = &state.jobs[&task].spec;
        assert_eq!(spec.name, "renamed");
        assert!(std::sync::Arc::ptr_eq(spec.script.as_ref().unwrap(), array_spec.script.as_ref().unwrap()));
    }
}

/// Lookups and cancels of tasks of an index set with the most ranges, created or not, answer
/// from the ranges (O(ranges)), never by walking every index.
#[test]
fn tasks_of_the_most_ranges_are_found_and_cancelled() {
    // Ranges of one index and of three (step 10) in turn, none of which could merge.
    let ranges: Vec<ArrayRange> = (0..MAX_ARRAY_RANGES as u32)
        .map(|i| ArrayRange { first: i * 24, last: i * 24 + 20 * (i % 2), step: 10 })
        .collect();
    let array_spec = ArraySpec { ranges, max_running: Some(4) };
    array_spec.validate().expect("the most ranges are legal");
    let total = array_spec.len();
    let last = array_spec.index_at(total - 1).unwrap();
    let mut state = configured();
    let array = submit(&mut state, 10, small_spec(), array_spec.clone());
    assert_eq!(state.array_live_tasks(array), 4);
    assert_eq!(state.array_task(array, last), None, "not created yet");
    state
        .apply(&at(20, Command::CancelArrayTask { array, index: last, reason: "not needed".into() }))
        .expect("cancels an index not created yet");
    assert_eq!(state.pending_count_of("default"), total - 1, "its task no longer counts");
    let missing = last + 1;
    let err = state.apply(&at(21, Command::CancelArrayTask { array, index: missing, reason: String::new() }));
    assert!(err.unwrap_err().to_string().contains(&format!("has no task {missing}")));
    let first = state.array_task(array, 0).expect("created");
    state.apply(&at(22, Command::CancelArrayTask { array, index: 0, reason: String::new() })).expect("cancel");
    assert_eq!(state.jobs[&first].state, JobState::Cancelled);
    // One more range than allowed is refused, and nothing is created.
    let mut too_many = array_spec;
    too_many.ranges.push(ArrayRange { first: MAX_ARRAY_TASKS - 1, last: MAX_ARRAY_TASKS - 1, step: 1 });
    let jobs = state.jobs.len();
    let mut spec = small_spec();
    spec.array = Some(too_many);
    let err = state.apply(&at(30, Command::SubmitJob { request_id: "big".into(), spec })).unwrap_err();
    assert!(err.to_string().starts_with("invalid array: 4097 ranges, at most 4096"), "{err}");
    assert_eq!(state.jobs.len(), jobs);
}
