//! Property tests (fuzzing) of the `ipset save` parser: arbitrary text never panics; entries that
//! parse render back to text that parses to the same entry; and save text that parses renders
//! (`render_save`) to text that parses to the same state (no diff). Cases: `PROPTEST_CASES`
//! (default 256).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ipset::{diff, parse_save, render_save, Entry, SetType};
use proptest::prelude::*;

const TYPES: [SetType; 5] = [
    SetType::HashIp,
    SetType::HashIpPort,
    SetType::HashIpPortIp,
    SetType::HashIpPortNet,
    SetType::BitmapPort,
];

/// Pieces real `ipset save` output is made of, to build near-valid text.
fn token() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("create".to_string()),
        Just("add".to_string()),
        Just("KUBE-CLUSTER-IP".to_string()),
        Just("KUBE-LOOP-BACK".to_string()),
        Just("KUBE-NODE-PORT-TCP".to_string()),
        Just("KUBE-LOAD-BALANCER-SOURCE-CIDR".to_string()),
        Just("hash:ip,port".to_string()),
        Just("hash:ip,port,ip".to_string()),
        Just("hash:ip,port,net".to_string()),
        Just("bitmap:port".to_string()),
        Just("hash:net".to_string()),
        Just("family".to_string()),
        Just("inet".to_string()),
        Just("inet6".to_string()),
        Just("hashsize".to_string()),
        Just("maxelem".to_string()),
        Just("range".to_string()),
        Just("0-65535".to_string()),
        Just("comment".to_string()),
        Just("timeout".to_string()),
        any::<u32>().prop_map(|n| n.to_string()),
        entry_text(),
        "[ -~]{0,12}",
    ]
}

/// Entry-shaped text: addresses, protocols, ports and networks joined by commas.
fn entry_text() -> impl Strategy<Value = String> {
    let ip = prop_oneof![
        any::<[u8; 4]>().prop_map(|b| std::net::Ipv4Addr::from(b).to_string()),
        any::<[u8; 16]>().prop_map(|b| std::net::Ipv6Addr::from(b).to_string()),
        "[0-9a-f.:]{0,12}",
    ];
    let pp = (
        prop_oneof![
            Just("tcp"),
            Just("udp"),
            Just("sctp"),
            Just("icmp"),
            Just("")
        ],
        any::<u32>(),
    )
        .prop_map(|(p, n)| format!("{p}:{}", n % 70_000));
    let part = prop_oneof![
        ip.clone(),
        pp,
        (ip, 0u8..140).prop_map(|(a, l)| format!("{a}/{l}")),
        any::<u16>().prop_map(|n| n.to_string()),
    ];
    proptest::collection::vec(part, 1..4).prop_map(|v| v.join(","))
}

fn save_text() -> impl Strategy<Value = String> {
    proptest::collection::vec(proptest::collection::vec(token(), 0..10), 0..20).prop_map(|lines| {
        lines
            .into_iter()
            .map(|l| l.join(" "))
            .collect::<Vec<_>>()
            .join("\n")
    })
}

proptest! {
    #[test]
    fn entries_parse_render_parse(text in prop_oneof![entry_text(), "[ -~]{0,40}"]) {
        for t in TYPES {
            if let Ok(e) = Entry::parse(t, &text) {
                let rendered = e.to_string();
                let back = Entry::parse(t, &rendered);
                prop_assert_eq!(back.as_ref().ok(), Some(&e), "{} -> {}", text, rendered);
            }
        }
    }

    #[test]
    fn save_text_never_panics_and_round_trips(text in save_text()) {
        let Ok(state) = parse_save(&text, |n| n.starts_with("KUBE-")) else {
            return Ok(());
        };
        let rendered = render_save(&state);
        let back = parse_save(&rendered, |_| true);
        prop_assert!(back.is_ok(), "render_save output does not parse: {:?}\n{}", back.err(), rendered);
        let back = back.unwrap();
        prop_assert!(diff(&state, &back).is_empty(), "{}\n---\n{}", text, rendered);
        prop_assert_eq!(render_save(&back), rendered);
    }
}

/// The generators reach the parsers' success paths (so the round trips are not vacuous).
#[test]
fn generators_reach_valid_input() {
    let e = Entry::parse(SetType::HashIpPort, "10.96.0.10,tcp:80").unwrap();
    assert_eq!(e.to_string(), "10.96.0.10,tcp:80");
    let st = parse_save(
        "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536\nadd KUBE-CLUSTER-IP 10.96.0.10,tcp:80",
        |_| true,
    )
    .unwrap();
    assert_eq!(st.entry_count(), 1);
}
