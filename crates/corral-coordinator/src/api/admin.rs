//! The user API's admin calls — tokens (create, list, revoke), the cluster policy (show,
//! diff and apply, history), node modes (cordon, drain, resume) and node removal — and the
//! node listing every caller may read (a tenant sees only its own jobs on the GPUs).
//!
//! Every call but `ListNodes` is for admins, checked before anything else; each handler's doc
//! comment states what bounds its cost.

use crate::reply::{node_view, token_info};
use crate::snapshot::Snapshot;
use crate::{policy, CoordError, Coordinator};
use corral_core::{Command, Outcome};
use corral_proto::v1::{self as pb};
use corral_types::{NodeMode, Timestamp};
use tonic::{Request, Response, Status};

/// `Corral.CreateToken`. Cost: one timestamp and one log entry; the cluster keeps at most
/// `corral_core::MAX_TOKENS` tokens.
pub(super) async fn create_token(
    coord: &Coordinator,
    request: Request<pb::CreateTokenRequest>,
) -> Result<Response<pb::CreateTokenResponse>, Status> {
    let who = coord.principal(&request, "token create")?;
    coord.require_admin(&request, "token create", &who)?;
    let req = request.get_ref().clone();
    if req.admin != req.tenant.is_empty() {
        return Err(Status::invalid_argument("give either a tenant or --admin, not both"));
    }
    let ts = coord.timestamps(1).await?;
    let expires_at_ms = match req.ttl_secs {
        Some(0) => return Err(Status::invalid_argument("--ttl must be greater than zero")),
        Some(secs) => Some(ts.physical_ms().saturating_add(secs.saturating_mul(1000))),
        None => None,
    };
    let secret = crate::auth::new_token_secret();
    let command = Command::CreateToken {
        tenant: req.tenant.clone(),
        admin: req.admin,
        sha256: crate::auth::token_sha256(&secret),
        expires_at_ms,
    };
    let token_id = match coord.propose_at(ts, command).await? {
        Outcome::TokenCreated { token_id } => token_id,
        other => return Err(Status::internal(format!("unexpected outcome of token create: {other:?}"))),
    };
    let whom = if req.admin { "admin".to_string() } else { format!("tenant {}", req.tenant) };
    coord.audit_admin(&request, "token create", &who, format!("token {token_id} for {whom}"));
    let token = coord.snapshot().read().state.tokens.get(&token_id).map(token_info);
    Ok(Response::new(pb::CreateTokenResponse { token, secret }))
}

/// `Corral.ListTokens`. Cost: every token record, at most `corral_core::MAX_TOKENS`, read
/// under the state lock (a record is a few dozen bytes, never its secret).
pub(super) fn list_tokens(
    coord: &Coordinator,
    snapshot: &Snapshot,
    request: Request<pb::ListTokensRequest>,
) -> Result<Response<pb::ListTokensResponse>, Status> {
    let who = coord.principal(&request, "token list")?;
    coord.require_admin(&request, "token list", &who)?;
    let tokens = snapshot.read().state.tokens.values().map(token_info).collect();
    Ok(Response::new(pb::ListTokensResponse { tokens }))
}

/// `Corral.RevokeToken`. Cost: one log entry.
pub(super) async fn revoke_token(
    coord: &Coordinator,
    request: Request<pb::RevokeTokenRequest>,
) -> Result<Response<pb::TokenInfo>, Status> {
    let who = coord.principal(&request, "token revoke")?;
    coord.require_admin(&request, "token revoke", &who)?;
    let token_id = request.get_ref().token_id;
    coord.propose(Command::RevokeToken { token_id }).await?;
    coord.audit_admin(&request, "token revoke", &who, format!("token {token_id}"));
    let token = coord.snapshot().read().state.tokens.get(&token_id).map(token_info);
    token.map(Response::new).ok_or_else(|| Status::not_found(format!("token {token_id} not found")))
}

/// `Corral.GetPolicy`. Cost: the policy in force rendered as TOML (its size is that of the
/// policy an admin applied, at most the user message limit).
pub(super) fn get_policy(
    coord: &Coordinator,
    snapshot: &Snapshot,
    request: Request<pb::GetPolicyRequest>,
) -> Result<Response<pb::PolicyFile>, Status> {
    let who = coord.principal(&request, "policy show")?;
    coord.require_admin(&request, "policy show", &who)?;
    let data = snapshot.read();
    let version = data.state.policy_version;
    Ok(Response::new(pb::PolicyFile { version, toml: policy::render_policy(&data.state.config, version) }))
}

/// `Corral.ApplyPolicy` (and its dry run, `corral admin diff`). Cost: a policy of at most the
/// user message limit, parsed before anything else; the plan compares it with the policy in
/// force and looks at every live job it could strand (bounded by the tenants' job limits of the
/// policy, under the state's read lock); one log entry.
pub(super) async fn apply_policy(
    coord: &Coordinator,
    request: Request<pb::ApplyPolicyRequest>,
) -> Result<Response<pb::ApplyPolicyResponse>, Status> {
    let action = if request.get_ref().dry_run { "policy diff" } else { "policy apply" };
    let who = coord.principal(&request, action)?;
    coord.require_admin(&request, action, &who)?;
    let req = request.get_ref();
    let source = if req.source.is_empty() { "policy" } else { req.source.as_str() };
    let config = policy::parse_policy(source, &req.toml).map_err(Status::invalid_argument)?;
    coord.linearizable().await?;
    let (plan, version) = {
        let snapshot = coord.snapshot();
        let data = snapshot.read();
        (data.state.plan_policy(&config).map_err(CoordError::Rejected)?, data.state.policy_version)
    };
    let stranded = |ids: &[(u64, corral_types::JobState, String)]| {
        ids.iter()
            .map(|(id, state, why)| pb::StrandedJob { job_id: *id, state: state.to_string(), reason: why.clone() })
            .collect::<Vec<_>>()
    };
    if req.dry_run {
        return Ok(Response::new(pb::ApplyPolicyResponse {
            version,
            changes: plan.changes,
            applied: false,
            stranded: stranded(&plan.stranded),
        }));
    }
    let command = Command::ApplyPolicy { config, by: who.describe(), force: req.force };
    let (version, changes, cancelled) = match coord.propose(command).await? {
        Outcome::PolicyApplied { version, changes, cancelled } => (version, changes, cancelled),
        other => return Err(Status::internal(format!("unexpected outcome of policy apply: {other:?}"))),
    };
    if !changes.is_empty() {
        let mut detail = format!("version {version}: {}", changes.join("; "));
        if !cancelled.is_empty() {
            detail.push_str(&format!("; cancelled jobs {cancelled:?}"));
        }
        coord.audit_admin(&request, "policy apply", &who, detail);
    }
    let gone: Vec<_> = plan.stranded.iter().filter(|(id, ..)| cancelled.contains(id)).cloned().collect();
    Ok(Response::new(pb::ApplyPolicyResponse {
        version,
        applied: !changes.is_empty(),
        changes,
        stranded: stranded(&gone),
    }))
}

/// `Corral.PolicyHistory`. Cost: the recorded changes, at most
/// `corral_core::MAX_POLICY_HISTORY`.
pub(super) fn policy_history(
    coord: &Coordinator,
    snapshot: &Snapshot,
    request: Request<pb::PolicyHistoryRequest>,
) -> Result<Response<pb::PolicyHistoryResponse>, Status> {
    let who = coord.principal(&request, "policy history")?;
    coord.require_admin(&request, "policy history", &who)?;
    let data = snapshot.read();
    let changes = data
        .state
        .policy_history
        .iter()
        .map(|r| pb::PolicyChange {
            version: r.version,
            ts: r.ts.0,
            by: r.by.clone(),
            changes: r.changes.clone(),
            cancelled: r.cancelled.clone(),
        })
        .collect();
    Ok(Response::new(pb::PolicyHistoryResponse { changes }))
}

/// `Corral.SetNodeMode` (cordon, drain, resume). Cost: one timestamp and one log entry; the
/// reply counts the node's running jobs.
pub(super) async fn set_node_mode(
    coord: &Coordinator,
    request: Request<pb::SetNodeModeRequest>,
) -> Result<Response<pb::NodeModeResponse>, Status> {
    let req = request.get_ref().clone();
    let (mode, action) = match req.mode.as_str() {
        "active" => (NodeMode::Active, "node resume"),
        "cordoned" => (NodeMode::Cordoned, "node cordon"),
        "draining" => (NodeMode::Draining, "node drain"),
        other => {
            return Err(Status::invalid_argument(format!("unknown node mode '{other}' (active, cordoned or draining)")))
        }
    };
    let who = coord.principal(&request, action)?;
    coord.require_admin(&request, action, &who)?;
    if req.deadline_secs.is_some() && mode != NodeMode::Draining {
        return Err(Status::invalid_argument("--deadline goes with drain only"));
    }
    let ts = coord.timestamps(1).await?;
    let drain_deadline =
        req.deadline_secs.map(|secs| Timestamp::compose(ts.physical_ms().saturating_add(secs.saturating_mul(1000)), 0));
    let command = Command::SetNodeMode { node: req.node.clone(), mode, reason: req.reason.clone(), drain_deadline };
    coord.propose_at(ts, command).await?;
    let detail = match (&drain_deadline, req.reason.is_empty()) {
        (Some(_), _) => format!("node {} ({}; deadline in {}s)", req.node, req.reason, req.deadline_secs.unwrap_or(0)),
        (None, false) => format!("node {} ({})", req.node, req.reason),
        (None, true) => format!("node {}", req.node),
    };
    coord.audit_admin(&request, action, &who, detail);
    node_mode_reply(coord, &req.node)
}

/// `Corral.SetNodeLease` (`corral node lease`). Cost: one log entry.
pub(super) async fn set_node_lease(
    coord: &Coordinator,
    request: Request<pb::SetNodeLeaseRequest>,
) -> Result<Response<pb::NodeModeResponse>, Status> {
    let action = "node lease";
    let who = coord.principal(&request, action)?;
    coord.require_admin(&request, action, &who)?;
    let req = request.get_ref().clone();
    if req.lease_end_ms.is_some_and(|ms| ms >> (64 - Timestamp::LOGICAL_BITS) != 0) {
        return Err(Status::invalid_argument("the lease end is out of range"));
    }
    let lease_end = req.lease_end_ms.map(|ms| Timestamp::compose(ms, 0));
    coord.propose(Command::SetNodeLease { node: req.node.clone(), lease_end }).await?;
    let detail = match lease_end {
        Some(t) => format!("node {} until {}", req.node, corral_types::format_utc(t)),
        None => format!("node {} cleared", req.node),
    };
    coord.audit_admin(&request, action, &who, detail);
    node_mode_reply(coord, &req.node)
}

/// A node's state as `corral node drain|cordon|resume|lease` print it.
fn node_mode_reply(coord: &Coordinator, name: &str) -> Result<Response<pb::NodeModeResponse>, Status> {
    let req = pb::SetNodeLeaseRequest { node: name.to_string(), lease_end_ms: None };
    let snapshot = coord.snapshot();
    let data = snapshot.read();
    let node = data
        .state
        .nodes
        .get(&req.node)
        .ok_or_else(|| Status::not_found(format!("node '{}' is not registered", req.node)))?;
    let running = data.state.jobs_on_node(&req.node).count();
    Ok(Response::new(pb::NodeModeResponse {
        node: req.node.clone(),
        state: node.display_state(running).to_string(),
        reason: node.mode_reason.clone(),
        drain_deadline: node.drain_deadline.map(|t| t.0),
        running_jobs: running as u32,
        lease_end: node.lease_end().map(|t| t.0),
    }))
}

/// `Corral.RemoveNode`. Cost: one log entry.
pub(super) async fn remove_node(
    coord: &Coordinator,
    request: Request<pb::RemoveNodeRequest>,
) -> Result<Response<pb::RemoveNodeResponse>, Status> {
    let who = coord.principal(&request, "node remove")?;
    coord.require_admin(&request, "node remove", &who)?;
    let node = request.get_ref().node.clone();
    let gpus = coord.snapshot().read().state.nodes.get(&node).map_or(0, |n| n.spec.gpus.len() as u32);
    coord.propose(Command::RemoveNode { node: node.clone(), revoke_certificates: true }).await?;
    coord.liveness().forget(&node);
    coord.pulls().forget(&node);
    coord.audit_admin(&request, "node remove", &who, format!("node {node} ({gpus} gpus)"));
    Ok(Response::new(pb::RemoveNodeResponse { gpus }))
}

/// `Corral.ListNodes`. Cost: every registered node with its GPUs and the jobs running on them
/// (the cluster's size, not the queue's), read under the state's read lock. The leader
/// registers the declared nodes of `[autoscale]` as soon as it leads; they are shown with their
/// power (`off`, `resuming`, ...).
pub(super) fn list_nodes(
    coord: &Coordinator,
    snapshot: &Snapshot,
    request: Request<pb::ListNodesRequest>,
) -> Result<Response<pb::ListNodesResponse>, Status> {
    let who = coord.principal(&request, "nodes")?;
    let data = snapshot.read();
    let autoscaler = coord.autoscaler();
    let nodes = data
        .state
        .nodes
        .values()
        .map(|n| {
            let live = coord.liveness().get(&n.spec.name).filter(|l| l.heard);
            let mut view = node_view(&data.state, n, live.as_ref(), &who);
            if let Some((state, reason)) = autoscaler.shown_state(&data.state, &n.spec.name) {
                (view.state, view.reason) = (state.to_string(), reason);
            }
            view
        })
        .collect();
    Ok(Response::new(pb::ListNodesResponse { nodes }))
}
