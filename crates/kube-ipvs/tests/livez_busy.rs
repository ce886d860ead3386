//! `/livez` and a sync step that waits on a busy program: a large `iptables-restore` computes
//! for minutes (iptables mode's first sync of thousands of Services), run window by window
//! while busy (`exec::Runner::while_busy`); the liveness of the step counts from the program's
//! last busy window, so the kubelet does not restart a daemon that is slow, not wedged. Its own
//! test binary: the busy moment it records is process-wide.

// Test code may unwrap/panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::ffi::OsStr;
use std::time::{Duration, Instant};

use kube_ipvs::health::ProxyHealth;

#[test]
fn a_step_waiting_on_a_busy_program_is_live_and_one_without_is_wedged() {
    let h =
        ProxyHealth::new(Duration::from_secs(60), None).with_liveness_bound(Duration::from_secs(2));
    let t0 = Instant::now();
    h.loop_working_at(t0);
    // A program that computes for about four seconds under a 500 ms limit per window.
    let busy = "end=$(( $(date +%s) + 4 )); while [ $(date +%s) -lt $end ]; do :; done";
    let worker = std::thread::spawn(|| {
        exec::Runner::new()
            .with_timeout(Duration::from_millis(500))
            .while_busy(Duration::from_secs(60))
            .run(OsStr::new("sh"), &["-c", busy], None)
    });
    // Past the bound while the program runs: still live (each busy window renews the step).
    let mut checked_past_bound = 0;
    while !worker.is_finished() {
        std::thread::sleep(Duration::from_millis(200));
        if t0.elapsed() > Duration::from_millis(2500) && !worker.is_finished() {
            let l = h.liveness_at(Instant::now());
            assert!(
                l.live,
                "wedged after {:?} while the program was busy",
                t0.elapsed()
            );
            checked_past_bound += 1;
        }
    }
    let out = worker.join().unwrap().unwrap();
    assert!(out.success, "{}", out.stderr);
    assert!(checked_past_bound > 0, "the program ended before the bound");
    // The step goes on with no busy program: wedged once the bound has passed since the last
    // busy window.
    std::thread::sleep(Duration::from_millis(2600));
    assert!(!h.liveness_at(Instant::now()).live);
}
