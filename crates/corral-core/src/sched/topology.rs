//! Which GPUs of one node a job gets: the tightest group that fits, so that a job's GPUs share a
//! PCIe switch (then a NUMA node) and big groups stay whole for big jobs; RDMA jobs prefer GPUs
//! with a NIC under their switch.

use corral_types::GpuDevice;
use std::collections::BTreeMap;

/// Picks `k` positions among `free` (positions into the node's GPU list, ascending), or `None`
/// if there are fewer. `devices[pos]` gives each position's topology.
pub(crate) fn choose(devices: &[&GpuDevice], free: &[usize], k: usize, rdma: bool) -> Option<Vec<usize>> {
    if free.len() < k {
        return None;
    }
    if k == 0 {
        return Some(Vec::new());
    }
    let with_nic: Vec<usize> = free.iter().copied().filter(|p| devices[*p].rdma_nic.is_some()).collect();
    let free = if rdma && with_nic.len() >= k { &with_nic[..] } else { free };
    if free.len() == k {
        return Some(free.to_vec());
    }
    // Groups: (numa, switch) -> positions. A GPU without a known switch is a group of its own.
    let mut switches: BTreeMap<(Option<u32>, SwitchKey), Vec<usize>> = BTreeMap::new();
    for &p in free {
        let d = devices[p];
        let key = match &d.pci_switch {
            Some(s) => SwitchKey::Known(s.as_str()),
            None => SwitchKey::Alone(p),
        };
        switches.entry((d.numa_node, key)).or_default().push(p);
    }
    // 1. The smallest switch group that holds the whole job.
    if let Some(group) = smallest_fitting(switches.values(), k) {
        return Some(group[..k].to_vec());
    }
    // 2. The smallest NUMA node that holds it, filled from its biggest switch groups.
    let mut numas: BTreeMap<Option<u32>, Vec<&Vec<usize>>> = BTreeMap::new();
    for ((numa, _), group) in &switches {
        numas.entry(*numa).or_default().push(group);
    }
    let numa_size = |groups: &Vec<&Vec<usize>>| groups.iter().map(|g| g.len()).sum::<usize>();
    let best_numa = numas
        .iter()
        .filter(|(_, groups)| numa_size(groups) >= k)
        .min_by_key(|(numa, groups)| (numa_size(groups), **numa))
        .map(|(_, groups)| groups.clone());
    if let Some(groups) = best_numa {
        return Some(take_biggest_first(groups, k));
    }
    // 3. Across NUMA nodes: biggest NUMA nodes first, biggest switch groups first inside each.
    let mut ordered: Vec<(Option<u32>, Vec<&Vec<usize>>)> = numas.into_iter().collect();
    ordered.sort_by(|a, b| numa_size(&b.1).cmp(&numa_size(&a.1)).then(a.0.cmp(&b.0)));
    let mut out = Vec::with_capacity(k);
    for (_, groups) in ordered {
        let want = k - out.len();
        let size = groups.iter().map(|g| g.len()).sum::<usize>();
        out.extend(take_biggest_first(groups, want.min(size)));
        if out.len() == k {
            break;
        }
    }
    out.sort_unstable();
    Some(out)
}

/// `choose(.., 1, ..)` without allocating: among the positions `free` accepts, one in the
/// smallest (NUMA node, PCIe switch) group of free GPUs, the lowest position on ties; RDMA jobs
/// take one with a NIC if there is any.
pub(crate) fn choose_one(devices: &[&GpuDevice], free: impl Fn(usize) -> bool, rdma: bool) -> Option<usize> {
    let n = devices.len();
    let nic_ok = |p: usize| !rdma || devices[p].rdma_nic.is_some();
    let any_nic = rdma && (0..n).any(|p| free(p) && devices[p].rdma_nic.is_some());
    let eligible = |p: usize| free(p) && (!any_nic || nic_ok(p));
    let same_group = |a: usize, b: usize| {
        let (x, y) = (devices[a], devices[b]);
        x.numa_node == y.numa_node && x.pci_switch.is_some() && x.pci_switch == y.pci_switch
    };
    (0..n)
        .filter(|p| eligible(*p))
        .min_by_key(|p| ((0..n).filter(|q| eligible(*q) && (*q == *p || same_group(*p, *q))).count(), *p))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum SwitchKey<'a> {
    Known(&'a str),
    Alone(usize),
}

fn smallest_fitting<'a>(groups: impl Iterator<Item = &'a Vec<usize>>, k: usize) -> Option<&'a Vec<usize>> {
    groups.filter(|g| g.len() >= k).min_by_key(|g| (g.len(), g[0]))
}

fn take_biggest_first(mut groups: Vec<&Vec<usize>>, k: usize) -> Vec<usize> {
    // A group that fits the rest exactly (or best) is taken before breaking a bigger one.
    let mut out = Vec::with_capacity(k);
    while out.len() < k {
        let want = k - out.len();
        let pick = smallest_fitting(groups.iter().copied(), want)
            .or_else(|| groups.iter().copied().max_by_key(|g| (g.len(), std::cmp::Reverse(g[0]))));
        let Some(group) = pick else { break };
        out.extend(group.iter().take(want));
        groups.retain(|g| !std::ptr::eq(*g, group));
    }
    out.sort_unstable();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `layout`: one `numa/switch[/nic]` per GPU, `-` for unknown.
    fn devices(layout: &str) -> Vec<GpuDevice> {
        layout
            .split_whitespace()
            .enumerate()
            .map(|(i, spec)| {
                let mut parts = spec.split('/');
                let numa = parts.next().and_then(|n| n.parse().ok());
                let switch = parts.next().filter(|s| *s != "-").map(str::to_string);
                let nic = parts.next().map(str::to_string);
                GpuDevice { index: i as u32, numa_node: numa, pci_switch: switch, rdma_nic: nic, ..Default::default() }
            })
            .collect()
    }

    fn check(layout: &str, free: &[usize], k: usize, rdma: bool, expected: Option<Vec<usize>>) {
        let devs = devices(layout);
        let refs: Vec<&GpuDevice> = devs.iter().collect();
        assert_eq!(choose(&refs, free, k, rdma), expected, "{layout} free={free:?} k={k} rdma={rdma}");
    }

    const DGX: &str = "0/a/mlx0 0/a 0/b 0/b 1/c/mlx1 1/c 1/d 1/d";

    #[test]
    fn same_switch_then_same_numa_then_spread() {
        // Two GPUs: a whole switch pair.
        check(DGX, &[0, 1, 2, 3, 4, 5, 6, 7], 2, false, Some(vec![0, 1]));
        // One GPU: from the most broken group, keeping whole pairs.
        check(DGX, &[1, 2, 3, 4, 5, 6, 7], 1, false, Some(vec![1]));
        // Two GPUs when pair a is broken: pair b, not 1 + something.
        check(DGX, &[1, 2, 3, 4, 5, 6, 7], 2, false, Some(vec![2, 3]));
        // Four: one NUMA node.
        check(DGX, &[1, 2, 3, 4, 5, 6, 7], 4, false, Some(vec![4, 5, 6, 7]));
        // Three on NUMA 0 (1 + pair b).
        check(DGX, &[1, 2, 3, 5, 6, 7], 3, false, Some(vec![1, 2, 3]));
        // Six: across NUMA nodes, the fuller one first.
        check(DGX, &[1, 2, 3, 4, 5, 6, 7], 6, false, Some(vec![2, 3, 4, 5, 6, 7]));
        check(DGX, &[0, 1], 3, false, None);
    }

    #[test]
    fn rdma_jobs_get_gpus_next_to_a_nic() {
        check(DGX, &[0, 1, 2, 3, 4, 5, 6, 7], 1, true, Some(vec![0]));
        check(DGX, &[1, 2, 3, 4, 5, 6, 7], 1, true, Some(vec![4]));
        check(DGX, &[0, 1, 2, 3, 4, 5, 6, 7], 2, true, Some(vec![0, 4]));
    }

    #[test]
    fn choose_one_agrees_with_choose() {
        for layout in [DGX, "- - - -", "0/a 0/a 1/b 1/c"] {
            let devs = devices(layout);
            let refs: Vec<&GpuDevice> = devs.iter().collect();
            for mask in 0u32..(1 << devs.len()) {
                let free: Vec<usize> = (0..devs.len()).filter(|p| mask & (1 << p) != 0).collect();
                for rdma in [false, true] {
                    let one = choose(&refs, &free, 1, rdma).map(|v| v[0]);
                    assert_eq!(choose_one(&refs, |p| mask & (1 << p) != 0, rdma), one, "{layout} {free:?} {rdma}");
                }
            }
        }
    }

    #[test]
    fn without_topology_it_is_first_fit() {
        check("- - - -", &[0, 1, 2, 3], 2, false, Some(vec![0, 1]));
        check("- - - -", &[1, 3], 1, false, Some(vec![1]));
    }
}
