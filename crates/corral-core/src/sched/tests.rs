//! Data-driven fixtures of the scheduling rules, one module (and one `check`) per rule. Each
//! fixture drives a `State` through apply() and prints the passes' decisions (see `testkit`).

mod quota {
    fn check(fixture: &str, expected: &str) {
        super::super::testkit::check(fixture, expected);
    }

    #[test]
    fn quota_hit_leaves_the_job_pending_with_the_numbers() {
        check(
            "
            tenant team-a quota=2
            node n1 gpus=8
            submit team-a gpus=1
            submit team-a gpus=1
            submit team-a gpus=1
            submit team-b gpus=2     # no policy: unlimited
            schedule
            ",
            "
            place 1 n1:0
            place 4 n1:1,2
            place 2 n1:3
            pending 3 quota: tenant team-a uses 2 of its 2 gpus and the job needs 1
            ",
        );
    }

    #[test]
    fn slices_count_their_fraction_and_class_caps_are_hard() {
        check(
            "
            tenant team-a quota=1.5 class-quota=gpu-high-priority:1
            node n1 gpus=4
            submit team-a slice=mps:50
            submit team-a gpus=1 class=gpu-high-priority
            submit team-a gpus=1 class=gpu-high-priority
            submit team-a slice=mps:50
            submit team-a slice=mps:25
            schedule
            ",
            "
            place 2 n1:0
            place 1 n1:1 mps:50:16384MiB
            pending 3 quota: tenant team-a may use 1 gpus of class gpu-high-priority, uses 1 and the job needs 1
            pending 4 quota: tenant team-a uses 1.5 of its 1.5 gpus and the job needs 0.5
            pending 5 quota: tenant team-a uses 1.5 of its 1.5 gpus and the job needs 0.25
            ",
        );
    }

    #[test]
    fn borrowing_within_a_cohort_up_to_the_borrowing_limit() {
        check(
            "
            tenant team-a quota=2 cohort=c borrow=1
            tenant team-b quota=4 cohort=c
            node n1 gpus=8
            submit team-a gpus=2
            submit team-a gpus=1     # borrows 1 of team-b's unused quota
            submit team-a gpus=1     # over the borrowing limit
            schedule
            ",
            "
            place 1 n1:0,1
            place 2 n1:2
            pending 3 quota: tenant team-a uses 3 gpus (quota 2) and may borrow at most 1 more; the job needs 1
            ",
        );
    }

    #[test]
    fn the_lender_reclaims_borrowed_quota_by_preemption() {
        check(
            "
            tenant team-a quota=2 cohort=c
            tenant team-b quota=2 cohort=c
            node n1 gpus=4
            run team-b gpus=2 on=n1:0,1
            time 100
            submit team-b gpus=2       # borrows team-a's unused quota
            step
            time 200
            submit team-a gpus=1       # team-a is within its quota: reclaim
            step
            show 2
            time 230
            schedule                   # still waiting: no new victims
            exit 2
            show 2
            step
            ",
            "
            place 2 n1:2,3
            preempt 2 by 3 grace 60s
            pending 3 preemption: waiting for 1 preempted job(s) to exit (grace period ends in 1m00s)
            job 2 running n1:2,3 [preempted by 3 grace 60s]
            pending 3 preemption: waiting for 1 preempted job(s) to exit (grace period ends in 30s)
            job 2 pending (requeued: preempted by job 3)
            place 3 n1:2
            pending 2 quota: cohort c uses 3 of its 4 gpus and the job needs 2
            ",
        );
    }

    #[test]
    fn a_borrower_does_not_preempt_to_borrow_more() {
        check(
            "
            tenant team-a quota=2 cohort=c
            tenant team-b quota=2 cohort=c
            node n1 gpus=4
            run team-a gpus=2 on=n1:0,1
            run team-b gpus=2 on=n1:2,3
            submit team-a gpus=1
            schedule
            ",
            "
            pending 3 quota: cohort c uses 4 of its 4 gpus and the job needs 1
            ",
        );
    }
}

mod preemption {
    fn check(fixture: &str, expected: &str) {
        super::super::testkit::check(fixture, expected);
    }

    const CLUSTER: &str = "
        node n1 gpus=4
        time 0
        run default gpus=1 class=preemptible on=n1:0      # 1: ran 1100 s
        time 1000
        run default gpus=1 class=preemptible on=n1:1      # 2: ran 100 s
        run default gpus=2 class=normal on=n1:2,3         # 3: ran 100 s on 2 gpus
        time 1100
    ";

    #[test]
    fn the_victim_is_the_job_that_loses_the_least_gpu_work() {
        check(
            &format!("{CLUSTER} submit default gpus=1 class=gpu-high-priority \n schedule"),
            "
            preempt 2 by 4 grace 30s
            pending 4 preemption: waiting for 1 preempted job(s) to exit (grace period ends in 30s)
            ",
        );
    }

    #[test]
    fn unnecessary_victims_are_dropped() {
        // Greedy by cost takes 2 (100 gpu-s) then 3 (200); 3 alone is enough, 1 + 2 would lose more.
        check(
            &format!("{CLUSTER} submit default gpus=2 class=gpu-high-priority \n schedule"),
            "
            preempt 3 by 4 grace 60s
            pending 4 preemption: waiting for 1 preempted job(s) to exit (grace period ends in 1m00s)
            ",
        );
    }

    #[test]
    fn only_classes_that_preempt_take_only_lower_classes() {
        check(
            &format!(
                "{CLUSTER}
                node n2 gpus=4
                run default gpus=4 class=gpu-high-priority on=n2:0,1,2,3   # 4: same class, never a victim
                submit default gpus=1 class=normal                         # 5: normal does not preempt
                submit default gpus=4 class=gpu-high-priority              # 6
                schedule
                "
            ),
            "
            preempt 2 by 6 grace 30s
            preempt 3 by 6 grace 60s
            preempt 1 by 6 grace 30s
            pending 6 preemption: waiting for 3 preempted job(s) to exit (grace period ends in 1m00s)
            pending 5 resources: needs 1 gpu on one node, at most 0 free on any node
            ",
        );
    }

    #[test]
    fn free_gpus_are_held_for_the_preemptor_except_for_jobs_that_end_first() {
        check(
            "
            node n1 gpus=2
            run default gpus=1 class=preemptible on=n1:0
            submit default gpus=2 class=gpu-high-priority   # needs the free gpu and job 1's
            submit default gpus=1                           # would take the free gpu for good
            submit default gpus=1 time=10s                  # ends before job 1's grace period does
            schedule
            ",
            "
            place 4 n1:1
            preempt 1 by 2 grace 30s
            pending 2 preemption: waiting for 1 preempted job(s) to exit (grace period ends in 30s)
            pending 3 priority: the free resources are held for job 2, ahead in the queue, until its preempted jobs exit
            ",
        );
    }

    #[test]
    fn victims_are_requeued_unless_they_opted_out() {
        check(
            "
            node n1 gpus=2
            run default gpus=1 class=preemptible on=n1:0
            run default gpus=1 class=preemptible no-requeue signal=10 on=n1:1
            time 60
            submit default gpus=2 class=gpu-high-priority
            step
            show 2
            exit 1
            exit 2
            show 1
            show 2
            step
            show 3
            ",
            "
            preempt 2 by 3 grace 30s
            preempt 1 by 3 grace 30s
            pending 3 preemption: waiting for 2 preempted job(s) to exit (grace period ends in 30s)
            job 2 running n1:1 [preempted by 3 grace 30s]
            job 1 pending (requeued: preempted by job 3)
            job 2 preempted (preempted by job 3 (the job opted out of requeueing)) [preempted by 3 grace 30s]
            place 3 n1:0,1
            pending 1 resources: needs 1 gpu on one node, at most 0 free on any node
            job 3 running n1:0,1
            ",
        );
    }
}

mod backfill {
    fn check(fixture: &str, expected: &str) {
        super::super::testkit::check(fixture, expected);
    }

    #[test]
    fn short_jobs_start_early_only_if_they_do_not_delay_the_top_job() {
        check(
            "
            config reservations=1
            node n1 gpus=5
            node n2 gpus=1
            run default gpus=2 time=1h on=n1:0,1     # 1: ends at 1h
            run default gpus=1 on=n1:2               # 2: no limit
            time 10m
            submit default gpus=4                    # 3: needs n1 at 1h
            submit default gpus=1 time=30m           # 4: ends before 1h: backfills n1
            submit default gpus=1 time=2h            # 5: too long for n1, fits n2
            submit default gpus=1                    # 6: no limit: would delay job 3
            schedule
            ",
            "
            place 4 n1:3
            place 5 n2:0
            pending 3 resources: needs 4 gpus on one node, at most 2 free on any node; reserved to start in 50m00s
            pending 6 backfill reservation: the free resources are held for job 3, which starts in 50m00s; a job with a shorter time limit could use them now
            ",
        );
    }

    #[test]
    fn the_surplus_of_a_reserved_node_stays_usable() {
        check(
            "
            config reservations=1
            node n1 gpus=8
            run default gpus=4 time=1h on=n1:0,1,2,3
            run default gpus=1 on=n1:4
            submit default gpus=6          # at 1h: 3 free + 4 = 7, so 1 is surplus
            submit default gpus=1          # takes the surplus
            submit default gpus=1
            schedule
            ",
            "
            place 4 n1:5
            pending 3 resources: needs 6 gpus on one node, at most 3 free on any node; reserved to start in 1h00m00s
            pending 5 backfill reservation: the free resources are held for job 3, which starts in 1h00m00s; a job with a shorter time limit could use them now
            ",
        );
    }

    #[test]
    fn without_time_limits_nothing_is_reserved() {
        check(
            "
            node n1 gpus=2
            run default gpus=1 on=n1:0
            submit default gpus=2
            submit default gpus=1
            schedule
            ",
            "
            place 3 n1:1
            pending 2 resources: needs 2 gpus on one node, at most 1 free on any node
            ",
        );
    }
}

mod gang {
    fn check(fixture: &str, expected: &str) {
        super::super::testkit::check(fixture, expected);
    }

    #[test]
    fn gangs_start_all_or_nothing() {
        check(
            "
            node n1 gpus=4
            node n2 gpus=4
            node n3 gpus=4
            run default gpus=2 on=n3:0,1
            submit default gpus=12 per-node=4     # 3 nodes x 4: only 2 nodes have 4 free
            submit default gpus=8 per-node=4
            submit default gpus=2
            step
            show 3
            ",
            "
            place 3 n1:0,1,2,3+n2:0,1,2,3
            place 4 n3:2,3
            pending 2 gang: needs 3 nodes with 4 gpus free each, 2 have them now
            job 3 running n1:0,1,2,3+n2:0,1,2,3
            ",
        );
    }

    #[test]
    fn a_gang_waits_for_its_reservation_and_node_loss_requeues_it_once_its_other_part_stopped() {
        check(
            "
            config reservations=1
            node n1 gpus=2
            node n2 gpus=2
            run default gpus=1 time=1h on=n2:0
            submit default gpus=4 per-node=2
            submit default gpus=1
            schedule
            time 1h
            finish 1
            step
            down n2
            show 2
            step
            exit 2 node=n1
            show 2
            ",
            "
            pending 2 gang: needs 2 nodes with 2 gpus free each, 1 have them now; reserved to start in 1h00m00s
            pending 3 backfill reservation: the free resources are held for job 2, which starts in 1h00m00s; a job with a shorter time limit could use them now
            place 2 n1:0,1+n2:0,1
            pending 3 resources: needs 1 gpu on one node, at most 0 free on any node
            job 2 running n1:0,1+n2:0,1 [ended: n2 lost]
            pending 3 resources: needs 1 gpu on one node, at most 0 free on any node
            job 2 pending (requeued: node n2 was lost while it ran part of the job)
            ",
        );
    }
}

mod placement {
    fn check(fixture: &str, expected: &str) {
        super::super::testkit::check(fixture, expected);
    }

    /// Among the nodes that fit, a job goes where the fewest of its image's bytes are missing
    /// (n2, which holds its base layer, over n1, equal for best fit); a node holding the whole
    /// image that has no room (n3) is not chosen; an image no worker holds changes nothing (best
    /// fit: the fullest node that fits).
    #[test]
    fn jobs_go_where_most_of_their_image_is_already() {
        check(
            "
            node n1 gpus=8
            node n2 gpus=8
            node n3 gpus=2
            image big base:900,app:100
            holds n2 base
            holds n3 base,app
            run default gpus=2 on=n3:0,1
            submit default gpus=2 image=big
            submit default gpus=2 image=unknown
            submit default gpus=2
            schedule
            ",
            "
            place 2 n2:0,1
            place 3 n2:2,3
            place 4 n2:4,5
            ",
        );
    }

    #[test]
    fn best_fit_keeps_whole_nodes_for_big_jobs() {
        // First fit would split n1 and leave no node for the 8-gpu job.
        check(
            "
            node n1 gpus=8
            node n2 gpus=8
            run default gpus=4 on=n2:0,1,2,3
            submit default gpus=2
            submit default gpus=2
            submit default gpus=8
            schedule
            ",
            "
            place 2 n2:4,5
            place 3 n2:6,7
            place 4 n1:0,1,2,3,4,5,6,7
            ",
        );
    }

    #[test]
    fn gpus_of_a_job_share_a_pcie_switch_then_a_numa_node() {
        check(
            "
            node n1 gpus=8 numa=0,0,0,0,1,1,1,1 switch=a,a,b,b,c,c,d,d nic=x,-,-,-,y,-,-,-
            run default gpus=1 on=n1:0
            submit default gpus=1          # completes broken pair a
            submit default gpus=2          # pair b
            submit default gpus=1 rdma     # next to nic y
            submit default gpus=2          # pair d
            schedule
            ",
            "
            place 2 n1:1
            place 3 n1:2,3
            place 4 n1:4
            place 5 n1:6,7
            ",
        );
    }

    #[test]
    fn unusable_gpus_and_down_nodes_get_nothing() {
        check(
            "
            node n1 gpus=2
            node n2 gpus=2
            down n2
            block n1:0
            submit default gpus=1
            submit default gpus=1
            schedule
            ",
            "
            place 1 n1:1
            pending 2 resources: needs 1 gpu on one node, at most 0 free on any node
            ",
        );
    }

    #[test]
    fn mig_slices_pack_without_fragmenting() {
        check(
            "
            node h1 gpus=2 model=H100 gpu-mem=81559 mig
            submit default slice=mig:3g.40gb
            submit default slice=mig:4g.40gb
            submit default slice=mig:1g.10gb
            submit default slice=mig:2g.20gb
            submit default slice=mig:7g.80gb
            submit default gpus=1
            schedule
            ",
            "
            place 1 h1:0 mig:3g.40gb@4
            place 2 h1:0 mig:4g.40gb@0
            place 3 h1:1 mig:1g.10gb@6
            place 4 h1:1 mig:2g.20gb@4
            pending 5 resources: no gpu has room for a mig:7g.80gb slice
            pending 6 resources: needs 1 gpu on one node, at most 0 free on any node
            ",
        );
    }

    #[test]
    fn mps_shares_never_over_commit_threads_or_memory() {
        check(
            "
            node r1 gpus=1
            submit default slice=mps:50
            submit default slice=mps:30:20GiB      # threads fit, memory does not
            submit default slice=mps:50
            submit default slice=mps:1
            schedule
            ",
            "
            place 1 r1:0 mps:50:16384MiB
            place 3 r1:0 mps:50:16384MiB
            pending 2 resources: no gpu has room for a mps:30:20480MiB slice
            pending 4 resources: no gpu has room for a mps:1 slice
            ",
        );
    }
}

mod fair_share {
    fn check(fixture: &str, expected: &str) {
        super::super::testkit::check(fixture, expected);
    }

    #[test]
    fn past_usage_orders_tenants_inside_a_priority_level() {
        check(
            "
            node n1 gpus=4
            time 2h
            usage team-a 100      # gpu-hours in the last hour: team-a starts behind team-b
            submit team-a gpus=1
            submit team-a gpus=1
            submit team-a gpus=1
            submit team-b gpus=1
            submit team-b gpus=1
            submit team-b gpus=1
            schedule
            ",
            "
            place 4 n1:0
            place 1 n1:1
            place 5 n1:2
            place 2 n1:3
            pending 6 resources: needs 1 gpu on one node, at most 0 free on any node
            pending 3 resources: needs 1 gpu on one node, at most 0 free on any node
            ",
        );
    }

    #[test]
    fn priority_comes_before_fair_share() {
        check(
            "
            node n1 gpus=1
            usage team-b 1000
            submit team-a gpus=1
            submit team-b gpus=1 class=gpu-high-priority
            schedule
            ",
            "
            place 2 n1:0
            pending 1 resources: needs 1 gpu on one node, at most 0 free on any node
            ",
        );
    }

    #[test]
    fn weights_share_the_cluster_proportionally() {
        check(
            "
            tenant team-a weight=2
            node n1 gpus=6
            submit team-a gpus=1
            submit team-a gpus=1
            submit team-a gpus=1
            submit team-a gpus=1
            submit team-a gpus=1
            submit team-b gpus=1
            submit team-b gpus=1
            submit team-b gpus=1
            schedule
            ",
            "
            place 1 n1:0
            place 6 n1:1
            place 2 n1:2
            place 3 n1:3
            place 7 n1:4
            place 4 n1:5
            pending 5 resources: needs 1 gpu on one node, at most 0 free on any node
            pending 8 resources: needs 1 gpu on one node, at most 0 free on any node
            ",
        );
    }
}

mod slurm {
    fn check(fixture: &str, expected: &str) {
        super::super::testkit::check(fixture, expected);
    }

    #[test]
    fn nodes_without_gpus_and_gpus_split_over_nodes() {
        check(
            "
            node n1 gpus=2
            node n2 gpus=2
            submit default gpus=0 nodes=2        # -N 2 on CPUs only
            submit default gpus=2 per-node=1 nodes=2
            schedule
            ",
            "
            place 1 n1:+n2:
            place 2 n1:0+n2:0
            ",
        );
    }

    /// `-n N --gpus-per-task G` without `--nodes`: the fewest nodes that hold the tasks now,
    /// each with its busiest node's GPUs.
    #[test]
    fn tasks_spread_over_the_fewest_nodes_that_hold_them() {
        check(
            "
            node n1 gpus=4
            node n2 gpus=4
            node n3 gpus=4
            run default gpus=1 on=n3:0
            submit default gpus=7 tasks=7 per-task=1   # 4 + 3 tasks: two whole nodes
            submit default gpus=2 tasks=2 per-task=1   # one node holds both
            submit default gpus=4 tasks=2 per-task=2   # no node has 4 left, none 2 each on 2
            schedule
            ",
            "
            place 2 n1:0,1,2,3+n2:0,1,2,3
            place 3 n3:1,2
            pending 4 resources: needs 4 gpus on one node, at most 1 free on any node
            ",
        );
    }

    /// Busy nodes: the tasks spread wider rather than wait for a node to empty.
    #[test]
    fn spread_tasks_take_what_is_free_now() {
        check(
            "
            node n1 gpus=4
            node n2 gpus=4
            run default gpus=2 on=n1:0,1
            run default gpus=2 on=n2:0,1
            submit default gpus=4 tasks=4 per-task=1
            schedule
            ",
            "
            place 3 n1:2,3+n2:2,3
            ",
        );
    }

    #[test]
    fn exclusive_jobs_take_idle_nodes_whole() {
        check(
            "
            node n1 gpus=4
            node n2 gpus=4
            run default gpus=1 on=n1:0
            submit default gpus=1 exclusive       # n1 is busy: n2, all of it
            submit default gpus=1                  # not on n2 any more
            submit default gpus=1 exclusive       # no idle node left
            schedule
            ",
            "
            place 2 n2:0
            place 3 n1:1
            pending 4 resources: needs 1 idle node(s) (--exclusive), 1 gpu free on each; 0 have them now
            ",
        );
    }

    /// `--exclusive` without GPUs: as Slurm allocates such a job all the GRES of its nodes, it
    /// takes every GPU of an idle node (a card out for a fault excepted).
    #[test]
    fn an_exclusive_job_without_gpus_takes_all_of_its_nodes_gpus() {
        check(
            "
            node n1 gpus=4
            node n2 gpus=4
            run default gpus=1 on=n1:0
            submit default gpus=0 exclusive
            submit default gpus=1
            schedule
            ",
            "
            place 2 n2:0,1,2,3
            place 3 n1:1
            ",
        );
    }

    #[test]
    fn a_gpu_type_picks_nodes_of_that_model() {
        check(
            "
            node n1 gpus=2
            node n2 gpus=2 model=NVIDIA-A100-SXM4-80GB
            submit default gpus=1 gpu-type=a100
            submit default gpus=1 gpu-type=h100
            schedule
            ",
            "
            place 1 n2:0
            pending 2 resources: needs 1 node(s) with h100 gpus, 1 gpu free on each; 0 have them now
            ",
        );
    }
}
