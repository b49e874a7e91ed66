//! `kachedb bench remote`: the remote tier (`serve --remote`) against a Redis
//! Cluster, started for the run (3 masters on 127.0.0.1) unless `--remote`
//! names one.
//!
//! Two daemons stand for two nodes. Node A puts the blocks and its
//! write-behind is timed (first put to the last block written). Node B, empty,
//! fills them with one LOOKUP per batch of 64 keys (64 KiB blocks) or per
//! block (64 MiB blocks); B's local copies are deleted between rounds so each
//! round fills again. In the same run a plain Redis client (redis-rs, cluster
//! aware, every GET of a batch sent at once) reads the same values, the
//! baseline the fill is compared with. Last, the GET round trip of a local
//! block on B, idle and while fills run.

use crate::spawn::{DaemonProcess, TempDir};
use clap::Args;
use kachedb_client::{Client, ConnectOptions, Key};
use kachedb_daemon::remote::format;
use serde_json::json;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Options of `kachedb bench remote`.
#[derive(Debug, Args)]
pub struct RemoteArgs {
    /// Print one JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
    /// A short run (fewer blocks and rounds).
    #[arg(long)]
    pub quick: bool,
    /// Use this Redis Cluster (any node) instead of starting one.
    #[arg(long, value_name = "URL")]
    pub remote: Option<String>,
}

/// A cluster of redis-server processes in a temporary directory; stopped when dropped.
struct Cluster {
    procs: Vec<Child>,
    ports: Vec<u16>,
    _dir: TempDir,
}

impl Cluster {
    fn start(masters: usize) -> Result<Cluster, Box<dyn std::error::Error>> {
        let dir = TempDir::new("kachedb-redis")?;
        let ports: Vec<u16> = (0..masters).map(|_| free_port()).collect::<Result<_, _>>()?;
        let mut c = Cluster { procs: Vec::new(), ports, _dir: dir };
        for &p in &c.ports {
            let child = Command::new("redis-server")
                .args(["--port", &p.to_string(), "--bind", "127.0.0.1", "--cluster-enabled", "yes"])
                .args(["--cluster-config-file", &format!("nodes-{p}.conf"), "--cluster-require-full-coverage", "no"])
                .args(["--save", "", "--appendonly", "no", "--daemonize", "no", "--dir"])
                .arg(&c._dir.0)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("starting redis-server (apt-get install redis-server): {e}"))?;
            c.procs.push(child);
        }
        for &p in &c.ports {
            wait_for(|| cli(p, &["ping"]).contains("PONG"), "redis-server to answer PING")?;
        }
        let nodes: Vec<String> = c.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&nodes)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()?;
        if !out.status.success() {
            return Err(format!("redis-cli --cluster create: {}", String::from_utf8_lossy(&out.stdout)).into());
        }
        for &p in &c.ports {
            wait_for(|| cli(p, &["cluster", "info"]).contains("cluster_state:ok"), "the cluster to be ok")?;
        }
        Ok(c)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in &mut self.procs {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> std::io::Result<u16> {
    loop {
        let p = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        // The cluster bus listens on port + 10000.
        if p < 55_000 && std::net::TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok() {
            return Ok(p);
        }
    }
}

fn cli(port: u16, args: &[&str]) -> String {
    Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

fn wait_for(mut ok: impl FnMut() -> bool, what: &str) -> Result<(), Box<dyn std::error::Error>> {
    let t = Instant::now();
    while !ok() {
        if t.elapsed() > Duration::from_secs(30) {
            return Err(format!("timed out waiting for {what}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn client(d: &DaemonProcess) -> Result<Client, Box<dyn std::error::Error>> {
    Ok(Client::connect(&ConnectOptions { socket: Some(d.socket().to_path_buf()), ..Default::default() })?)
}

fn stats(d: &DaemonProcess) -> Result<kachedb_shm::Stats, Box<dyn std::error::Error>> {
    Ok(kachedb_client::daemon_stats(&ConnectOptions { socket: Some(d.socket().to_path_buf()), ..Default::default() })?)
}

/// GETs every chunk of `keys` with a plain cluster client, a batch at a time
/// (every GET of a batch sent at once); the bytes read.
fn plain_get(
    rt: &tokio::runtime::Runtime,
    conn: &redis::cluster_async::ClusterConnection,
    ns: &str,
    batches: &[Vec<(u128, u32)>],
) -> Result<u64, Box<dyn std::error::Error>> {
    rt.block_on(async {
        let mut bytes = 0u64;
        for batch in batches {
            let futs = batch.iter().flat_map(|&(key, chunks)| {
                (0..chunks).map(move |i| {
                    let mut c = conn.clone();
                    let k = format::chunk_key(ns, key, i);
                    async move { redis::cmd("GET").arg(k).query_async::<Option<Vec<u8>>>(&mut c).await }
                })
            });
            for v in futures_util::future::join_all(futs).await {
                bytes += v?.map_or(0, |v| v.len() as u64);
            }
        }
        Ok::<u64, Box<dyn std::error::Error>>(bytes)
    })
}

/// Runs the benchmark.
pub fn run(a: &RemoteArgs) -> Result<(), Box<dyn std::error::Error>> {
    let cluster = match &a.remote {
        Some(_) => None,
        None => Some(Cluster::start(3)?),
    };
    let url =
        a.remote.clone().unwrap_or_else(|| format!("redis://127.0.0.1:{}", cluster.as_ref().map_or(0, |c| c.ports[0])));
    let ns = format!("bench-{}", std::process::id());
    let (n_small, n_big, rounds) = if a.quick { (256usize, 2usize, 2usize) } else { (2048, 8, 5) };
    let (small_len, big_len) = (64usize << 10, 64usize << 20);
    let slab = (n_big * big_len + n_small * small_len) as u64 + (512 << 20);
    let opts = ["--remote", url.as_str(), "--remote-namespace", ns.as_str(), "--remote-queue-bytes", "4GiB"];
    let node_a = DaemonProcess::spawn(slab, &opts)?;
    let node_b = DaemonProcess::spawn(slab, &opts)?;
    let (ka, kb) = (client(&node_a)?, client(&node_b)?);
    let emit = |v: serde_json::Value, human: String| {
        if a.json {
            println!("{v}");
        } else {
            println!("{human}");
        }
    };
    if !a.json {
        println!("kachedb bench remote — {url}, namespace {ns}; two daemons (node A writes, node B fills)");
    }

    // Write-behind: A puts, then waits until every block is written.
    let small: Vec<Key> = (0..n_small).map(|i| Key::from_bytes(format!("rb/small/{i}").as_bytes())).collect();
    let big: Vec<Key> = (0..n_big).map(|i| Key::from_bytes(format!("rb/big/{i}").as_bytes())).collect();
    let small_data: Vec<Vec<u8>> = (0..n_small).map(|i| vec![(i % 251) as u8; small_len]).collect();
    let big_data: Vec<u8> = (0..big_len).map(|i| (i % 253) as u8).collect();
    for (keys, len, name) in [(&small, small_len, "64KiB"), (&big, big_len, "64MiB")] {
        let before = stats(&node_a)?.remote;
        let t = Instant::now();
        for (i, k) in keys.iter().enumerate() {
            if len == small_len {
                ka.put(*k, &small_data[i])?;
            } else {
                ka.put(*k, &big_data)?;
            }
        }
        let put_s = t.elapsed().as_secs_f64();
        wait_for_writes(&node_a)?;
        let s = t.elapsed().as_secs_f64();
        let r = stats(&node_a)?.remote;
        let bytes = (keys.len() * len) as f64;
        emit(
            json!({"bench":"remote_write_behind","block":name,"blocks":keys.len(),"put_s":put_s,"written_s":s,
                   "gb_per_s":bytes/s/1e9,"dropped":r.remote_dropped_writes-before.remote_dropped_writes,
                   "errors":r.remote_errors-before.remote_errors}),
            format!(
                "write-behind {name:>6} x {:>5}   {:>6.3} GB/s (all written {:.2} s after the first put; puts took {:.2} s)",
                keys.len(),
                bytes / s / 1e9,
                s,
                put_s
            ),
        );
    }

    // Fill on B against a plain client reading the same values.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let conn = rt.block_on(async {
        redis::cluster::ClusterClientBuilder::new(vec![url.as_str()]).build()?.get_async_connection().await
    })?;
    let cb = format::DEFAULT_CHUNK_BYTES;
    for (keys, len, name, batch) in [(&small, small_len, "64KiB", 64usize), (&big, big_len, "64MiB", 1)] {
        let chunks = format::chunk_count(len as u64, cb).unwrap_or(1);
        let batches: Vec<Vec<(u128, u32)>> =
            keys.chunks(batch).map(|c| c.iter().map(|k| (k.0, chunks)).collect()).collect();
        let (mut fill_s, mut plain_s) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            kb.delete_many(keys)?;
            let t = Instant::now();
            for c in keys.chunks(batch) {
                let n = kb.lookup(c)?;
                if n != c.len() {
                    return Err(format!("node B found {n} of {} blocks", c.len()).into());
                }
            }
            fill_s.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            let got = plain_get(&rt, &conn, &ns, &batches)?;
            plain_s.push(t.elapsed().as_secs_f64());
            if got < (keys.len() * len) as u64 {
                return Err("the plain client read fewer bytes than stored".into());
            }
        }
        fill_s.sort_by(f64::total_cmp);
        plain_s.sort_by(f64::total_cmp);
        let (f, p) = (fill_s[rounds / 2], plain_s[rounds / 2]);
        let bytes = (keys.len() * len) as f64;
        emit(
            json!({"bench":"remote_fill","block":name,"blocks":keys.len(),"keys_per_lookup":batch,
                   "fill_gb_per_s":bytes/f/1e9,"plain_get_gb_per_s":bytes/p/1e9,"fill_vs_plain":p/f,"rounds":rounds}),
            format!(
                "fill {name:>6} x {:>5}   {:>6.3} GB/s vs plain client GET {:>6.3} GB/s ({:.0} %), median of {rounds}",
                keys.len(),
                bytes / f / 1e9,
                bytes / p / 1e9,
                p / f * 100.0
            ),
        );
    }

    // Local GET round trip on B: idle, then while another client keeps filling.
    let local = Key::from_bytes(b"rb/local");
    kb.put(local, &[1u8; 4096])?;
    let iters = if a.quick { 5_000 } else { 50_000 };
    let time_gets = |n: usize| -> Result<Vec<u64>, Box<dyn std::error::Error>> {
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            let g = kb.get(local)?;
            v.push(t.elapsed().as_nanos() as u64);
            drop(g);
        }
        v.sort_unstable();
        Ok(v)
    };
    let idle = time_gets(iters)?;
    let stop = Arc::new(AtomicBool::new(false));
    let filler = {
        let (stop, sock, keys) = (stop.clone(), node_b.socket().to_path_buf(), small.clone());
        std::thread::spawn(move || -> u64 {
            let Ok(c) = Client::connect(&ConnectOptions { socket: Some(sock), ..Default::default() }) else { return 0 };
            let mut fills = 0;
            while !stop.load(Ordering::Relaxed) {
                for ch in keys.chunks(64) {
                    let _ = c.delete_many(ch);
                    fills += c.lookup(ch).unwrap_or(0) as u64;
                }
            }
            fills
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let busy = time_gets(iters)?;
    stop.store(true, Ordering::Relaxed);
    let fills = filler.join().unwrap_or(0);
    emit(
        json!({"bench":"remote_local_get_during_fills","iters":iters,"idle_p50_ns":percentile(&idle,0.5),
               "idle_p99_ns":percentile(&idle,0.99),"busy_p50_ns":percentile(&busy,0.5),"busy_p99_ns":percentile(&busy,0.99),
               "fills_meanwhile":fills}),
        format!(
            "local GET on B          p50 {} ns / p99 {} ns idle; p50 {} ns / p99 {} ns while {fills} fills ran",
            percentile(&idle, 0.5),
            percentile(&idle, 0.99),
            percentile(&busy, 0.5),
            percentile(&busy, 0.99)
        ),
    );
    let rb = stats(&node_b)?.remote;
    emit(
        json!({"bench":"remote_counters","node_b":{"fills":rb.remote_fills,"fetches":rb.remote_fetches,
               "errors":rb.remote_errors,"corrupt":rb.remote_corrupt,"fill_ms_mean":rb.remote_fill_ms_mean}}),
        format!(
            "node B counters         {} fills in {} fetches, {} errors, {} corrupt, fill {:.2} ms mean",
            rb.remote_fills, rb.remote_fetches, rb.remote_errors, rb.remote_corrupt, rb.remote_fill_ms_mean
        ),
    );
    drop((ka, kb));
    drop((node_a, node_b));
    drop(cluster);
    Ok(())
}

fn wait_for_writes(d: &DaemonProcess) -> Result<(), Box<dyn std::error::Error>> {
    let t = Instant::now();
    loop {
        let r = stats(d)?.remote;
        // Every put was queued (or dropped) when its commit was answered.
        if r.remote_queue_blocks == 0 {
            return Ok(());
        }
        if t.elapsed() > Duration::from_secs(600) {
            return Err("the write-behind did not finish within 600 s".into());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
