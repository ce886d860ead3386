//! Benchmark of the static directory source's reading and parsing (no kernel, no root).
//!
//! ```text
//! static-dir-bench [SERVICES] [REALS] [ROUNDS]
//! ```
//!
//! Writes SERVICES Service files and SERVICES EndpointSlice files (REALS ready endpoints each)
//! into a temporary directory and reports, over ROUNDS rounds (min / median / max):
//! - `load`: one full read (`static_dir::load`, what `--once` and `plan` do);
//! - `parse`: parsing the same texts on one thread (no IO);
//! - `start`: the watching source from start to its initial list;
//! - `change`: one EndpointSlice file rewritten → its `Apply` event (write → event latency).

// A benchmark driver: a failure is fatal.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ::watch::static_dir::{self, StaticDirSource};
use model::event::{Kind, Object, SourceEvent};
use tokio::sync::mpsc;

fn service(i: usize) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: svc-{i}\n  namespace: bench\n  labels:\n    app: svc-{i}\nspec:\n  type: ClusterIP\n  clusterIP: 10.96.{}.{}\n  selector:\n    app: svc-{i}\n  ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n",
        i / 250,
        i % 250 + 1
    )
}

fn slice(i: usize, reals: usize, gen: usize) -> String {
    let mut s = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: svc-{i}-abcde\n  namespace: bench\n  labels:\n    kubernetes.io/service-name: svc-{i}\n    endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io\naddressType: IPv4\nports:\n- name: http\n  port: 8080\n  protocol: TCP\nendpoints:\n"
    );
    for r in 0..reals {
        let n = i * reals + r + gen;
        s.push_str(&format!(
            "- addresses:\n  - 10.244.{}.{}\n  conditions:\n    ready: true\n    serving: true\n    terminating: false\n  nodeName: node-{}\n  targetRef:\n    kind: Pod\n    name: svc-{i}-pod-{r}\n    namespace: bench\n",
            (n / 250) % 256,
            n % 250 + 1,
            r % 3
        ));
    }
    s
}

fn write(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

fn stats(mut v: Vec<Duration>) -> String {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    format!(
        "min {:.1} ms, median {:.1} ms, max {:.1} ms (n={})",
        ms(v[0]),
        ms(v[v.len() / 2]),
        ms(v[v.len() - 1]),
        v.len()
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers"))
        .collect();
    let services = args.first().copied().unwrap_or(1000);
    let reals = args.get(1).copied().unwrap_or(10);
    let rounds = args.get(2).copied().unwrap_or(5).max(1);
    let dir = std::env::temp_dir().join(format!("static-dir-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut texts: Vec<(PathBuf, String)> = Vec::new();
    for i in 0..services {
        let (s, e) = (service(i), slice(i, reals, 0));
        write(&dir, &format!("svc-{i:05}.yaml"), &s);
        write(&dir, &format!("svc-{i:05}-slice.yaml"), &e);
        texts.push((dir.join(format!("svc-{i:05}.yaml")), s));
        texts.push((dir.join(format!("svc-{i:05}-slice.yaml")), e));
    }
    let bytes: usize = texts.iter().map(|(_, t)| t.len()).sum();
    println!(
        "{services} services, {reals} endpoints each: {} files, {} KiB",
        texts.len(),
        bytes / 1024
    );

    let mut load = Vec::new();
    let mut parse = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        let r = static_dir::load(&dir, "node-0").unwrap();
        load.push(t.elapsed());
        assert_eq!(r.snapshot.services.len(), services);
        let t = Instant::now();
        for (p, text) in &texts {
            static_dir::parse_file(p, text).unwrap();
        }
        parse.push(t.elapsed());
    }
    println!("load:   {}", stats(load));
    println!("parse:  {}", stats(parse));

    let mut start = Vec::new();
    let mut change = Vec::new();
    for round in 0..rounds {
        let (tx, mut rx) = mpsc::channel(4096);
        let t = Instant::now();
        let task = tokio::spawn(StaticDirSource::new(&dir, "node-0").run(tx));
        loop {
            match rx.recv().await.unwrap() {
                SourceEvent::InitDone(Kind::EndpointSlice) => break,
                _ => continue,
            }
        }
        start.push(t.elapsed());
        // Let the source settle (it may re-read after its own start).
        tokio::time::sleep(Duration::from_millis(500)).await;
        while rx.try_recv().is_ok() {}
        for k in 0..3 {
            let i = (round * 7 + k * 13) % services;
            let text = slice(i, reals, 1 + round * 3 + k);
            let t = Instant::now();
            write(&dir, &format!("svc-{i:05}-slice.yaml"), &text);
            let want = format!("svc-{i}-abcde");
            loop {
                let ev = tokio::time::timeout(Duration::from_secs(60), rx.recv())
                    .await
                    .expect("no event within 60 s")
                    .unwrap();
                let hit = match &ev {
                    SourceEvent::Apply(Object::EndpointSlice(s))
                    | SourceEvent::InitApply(Object::EndpointSlice(s)) => {
                        *s.name == *want
                            && s.endpoints.first().map(|e| e.ip.to_string())
                                == Some(format!(
                                    "10.244.{}.{}",
                                    ((i * reals + 1 + round * 3 + k) / 250) % 256,
                                    (i * reals + 1 + round * 3 + k) % 250 + 1
                                ))
                    }
                    _ => false,
                };
                if hit {
                    break;
                }
            }
            change.push(t.elapsed());
            tokio::time::sleep(Duration::from_millis(300)).await;
            while rx.try_recv().is_ok() {}
        }
        drop(rx);
        let _ = task.await;
    }
    println!("start:  {}", stats(start));
    println!("change: {} (write -> event, incl. debounce)", stats(change));
    let _ = std::fs::remove_dir_all(&dir);
}
