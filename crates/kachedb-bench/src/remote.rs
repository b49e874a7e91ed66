//! `kachedb-bench remote`: the remote tier (`serve --remote`) against a Redis
//! Cluster, started for the run (3 masters on 127.0.0.1) unless `--remote`
//! names one.
//!
//! Two daemons stand for two nodes. Node A puts the blocks and its
//! write-behind is timed (first put to the last block written). Node B, empty,
//! fills them with one LOOKUP per batch of 64 keys (64 KiB blocks), of 16
//! (1 MiB blocks, a chain: the fill reads each block's next-block hint) or
//! per block (64 MiB blocks); B's local copies are deleted between rounds so each
//! round fills again. In the same run a plain Redis client (redis-rs, cluster
//! aware, every GET of a batch sent at once) reads the same values, the
//! baseline the fill is compared with. Last, the GET round trip of a local
//! block on B, in windows alternating idle and while another client keeps
//! filling (medians over the windows); with `--nice-sweep`, for several nice
//! values of B's tier threads and of the redis-servers.
//!
//! Chain walk: node A puts chains of 20 blocks of 1 MiB, each naming its
//! parent; node B (`--remote-read-ahead` 8, the default) and a node B0
//! (`--remote-read-ahead 0`) GET them one block after another, their local
//! copies deleted before each walk, and the plain client GETs each block's
//! values one block after another (what a walk with nothing read ahead
//! costs), in turn, the order rotating every round; medians over the rounds.
//!
//! A second pair of daemons (A', B') runs with a fleet key
//! (`--remote-key-file`, keyed tags) in its own namespace: its
//! write-behind and fills are timed in the same run: B and B' fill the same
//! batches in turn, the order flipping every batch, and the keyed fill
//! throughput is printed as a share of the unkeyed one (the median of the
//! rounds' ratios).
//!
//! The redis-servers it starts run at `--redis-nice` (19 by default): they
//! stand for other machines, and take only CPU the node leaves idle.

use crate::spawn::{DaemonProcess, TempDir};
use clap::Args;
use kachedb_client::{Client, ConnectOptions, Key, Value};
use kachedb_daemon::remote::cells::RemoteStats;
use kachedb_daemon::remote::format;
use serde_json::json;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Options of `kachedb-bench remote`.
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
    /// Nice value of the redis-servers the benchmark starts. They stand in
    /// for other machines: at 19 they take only CPU the node itself leaves
    /// idle, as a cluster elsewhere would; the plain-client baseline reads
    /// the same servers. 0: as any other process.
    #[arg(long, default_value_t = 19, value_name = "N",
          value_parser = clap::value_parser!(i32).range(0..=19))]
    pub redis_nice: i32,
    /// Also time local GETs during fills with node B's tier threads and the
    /// redis-servers at nice 0, 10 and 19 (set by the benchmark while it
    /// runs; setting a nice value back to 0 needs root or CAP_SYS_NICE).
    #[arg(long)]
    pub nice_sweep: bool,
}

/// A cluster of redis-server processes in a temporary directory; stopped when dropped.
struct Cluster {
    procs: Vec<Child>,
    ports: Vec<u16>,
    _dir: TempDir,
}

impl Cluster {
    fn start(masters: usize, nice: i32) -> Result<Cluster, Box<dyn std::error::Error>> {
        let dir = TempDir::new("kachedb-redis")?;
        let ports: Vec<u16> = (0..masters).map(|_| free_port()).collect::<Result<_, _>>()?;
        let mut c = Cluster { procs: Vec::new(), ports, _dir: dir };
        for &p in &c.ports {
            let child = Command::new("nice")
                .args([
                    "-n",
                    &nice.to_string(),
                    "redis-server",
                    "--port",
                    &p.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--cluster-enabled",
                    "yes",
                ])
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

/// Sets the nice value of node `d`'s tier threads (`--nice-sweep`).
fn set_tier_nice(d: &DaemonProcess, n: i32) -> Result<(), Box<dyn std::error::Error>> {
    if renice(d.pid(), Some(kachedb_daemon::remote::THREAD_NAME), n) == 0 {
        return Err(format!(
            "--nice-sweep: could not set node B's tier threads to nice {n} (needs root or CAP_SYS_NICE)"
        )
        .into());
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
        None => Some(Cluster::start(3, a.redis_nice)?),
    };
    let url =
        a.remote.clone().unwrap_or_else(|| format!("redis://127.0.0.1:{}", cluster.as_ref().map_or(0, |c| c.ports[0])));
    let ns = format!("bench-{}", std::process::id());
    let (n_small, n_mid, n_big, rounds) = if a.quick { (256usize, 32usize, 2usize, 2usize) } else { (2048, 128, 8, 5) };
    let (small_len, mid_len, big_len) = (64usize << 10, 1usize << 20, 64usize << 20);
    let slab = (n_big * big_len + n_mid * mid_len + n_small * small_len) as u64 + (512 << 20);
    let opts = ["--remote", url.as_str(), "--remote-namespace", ns.as_str(), "--remote-queue-bytes", "4GiB"];
    let node_a = DaemonProcess::spawn(slab, &opts)?;
    let node_b = DaemonProcess::spawn(slab, &opts)?;
    let (ka, kb) = (client(&node_a)?, client(&node_b)?);
    // The keyed pair: a fleet key in a file only this user reads.
    let key_dir = TempDir::new("kachedb-bench-key")?;
    let key_file = key_dir.0.join("fleet.key");
    {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&key_file)?;
        let secret: String = (0..32u32).map(|i| format!("{:02x}", (i * 37 + std::process::id()) % 256)).collect();
        std::io::Write::write_all(&mut f, secret.as_bytes())?;
    }
    let ns_keyed = format!("{ns}-keyed");
    let key_path = key_file.to_string_lossy().into_owned();
    let opts_keyed = [
        "--remote",
        url.as_str(),
        "--remote-namespace",
        ns_keyed.as_str(),
        "--remote-queue-bytes",
        "4GiB",
        "--remote-key-file",
        key_path.as_str(),
    ];
    let node_ak = DaemonProcess::spawn(slab, &opts_keyed)?;
    let node_bk = DaemonProcess::spawn(slab, &opts_keyed)?;
    let (kak, kbk) = (client(&node_ak)?, client(&node_bk)?);
    let emit = |v: serde_json::Value, human: String| {
        if a.json {
            println!("{v}");
        } else {
            println!("{human}");
        }
    };
    if !a.json {
        println!("kachedb-bench remote — {url}, namespace {ns}; two daemons (node A writes, node B fills)");
        if cluster.is_some() {
            println!(
                "  the 3 redis-servers started here run at nice {} (they stand for other machines; the plain-client baseline reads the same servers)",
                a.redis_nice
            );
        }
    }

    // Write-behind: A puts, then waits until every block is written.
    let small: Vec<Key> = (0..n_small).map(|i| Key::from_bytes(format!("rb/small/{i}").as_bytes())).collect();
    let mid: Vec<Key> = (0..n_mid).map(|i| Key::from_bytes(format!("rb/mid/{i}").as_bytes())).collect();
    let big: Vec<Key> = (0..n_big).map(|i| Key::from_bytes(format!("rb/big/{i}").as_bytes())).collect();
    let small_data: Vec<Vec<u8>> = (0..n_small).map(|i| vec![(i % 251) as u8; small_len]).collect();
    let mid_data: Vec<Vec<u8>> = (0..n_mid).map(|i| vec![(i % 241) as u8; mid_len]).collect();
    let big_data: Vec<u8> = (0..big_len).map(|i| (i % 253) as u8).collect();
    for (keys, len, name) in [(&small, small_len, "64KiB"), (&mid, mid_len, "1MiB"), (&big, big_len, "64MiB")] {
        for (mac, writer, kw) in [(false, &node_a, &ka), (true, &node_ak, &kak)] {
            let before = RemoteStats::of(&stats(writer)?);
            let t = Instant::now();
            for (i, k) in keys.iter().enumerate() {
                // The 1 MiB blocks are a chain (each names the one before):
                // a batch fill reads their next-block hints and links them.
                match len {
                    _ if len == small_len => kw.put(*k, &small_data[i])?,
                    _ if len == mid_len => {
                        kw.put(*k, Value::bytes(&mid_data[i]).parent(i.checked_sub(1).map(|p| keys[p])))?
                    }
                    _ => kw.put(*k, &big_data)?,
                }
            }
            let put_s = t.elapsed().as_secs_f64();
            wait_for_writes(writer)?;
            let s = t.elapsed().as_secs_f64();
            let r = RemoteStats::of(&stats(writer)?);
            let bytes = (keys.len() * len) as f64;
            let mac_label = if mac { "MAC on " } else { "MAC off" };
            emit(
                json!({"bench":"remote_write_behind","block":name,"blocks":keys.len(),"mac":mac,"put_s":put_s,"written_s":s,
                       "gb_per_s":bytes/s/1e9,"dropped":r.remote_dropped_writes-before.remote_dropped_writes,
                       "errors":r.remote_errors-before.remote_errors}),
                format!(
                    "write-behind {name:>6} x {:>5}   {:>6.3} GB/s {mac_label} (all written {:.2} s after the first put; puts took {:.2} s)",
                    keys.len(),
                    bytes / s / 1e9,
                    s,
                    put_s
                ),
            );
        }
    }

    // Fill on B against a plain client reading the same values.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let conn = rt.block_on(async {
        redis::cluster::ClusterClientBuilder::new(vec![url.as_str()]).build()?.get_async_connection().await
    })?;
    let cb = format::DEFAULT_CHUNK_BYTES;
    for (keys, len, name, batch) in
        [(&small, small_len, "64KiB", 64usize), (&mid, mid_len, "1MiB", 16), (&big, big_len, "64MiB", 1)]
    {
        let chunks = format::chunk_count(len as u64, cb).unwrap_or(1);
        let batches: Vec<Vec<(u128, u32)>> =
            keys.chunks(batch).map(|c| c.iter().map(|k| (k.0, chunks)).collect()).collect();
        // With --nice-sweep, rows of node B alone with its tier threads at
        // nice 19 and 0, a round at a time.
        let sweep: Vec<i32> = if a.nice_sweep { vec![19, 0] } else { Vec::new() };
        let mut sweep_s = vec![Vec::new(); sweep.len()];
        // The MAC pair: node B (no key) and node B' (keyed) fill the same
        // batches in turn, the order flipping every batch, so both see the
        // same machine; per round, the sum of each one's LOOKUPs.
        let (mut pair_s, mut ratio, mut plain_s) = ([Vec::new(), Vec::new()], Vec::new(), Vec::new());
        let lookup = |kn: &Client, c: &[Key], keyed: bool| -> Result<f64, Box<dyn std::error::Error>> {
            let t = Instant::now();
            let n = kn.lookup(c)?;
            let s = t.elapsed().as_secs_f64();
            if n != c.len() {
                return Err(format!("node B{} found {n} of {} blocks", if keyed { "'" } else { "" }, c.len()).into());
            }
            Ok(s)
        };
        for round in 0..rounds {
            for (si, &n) in sweep.iter().enumerate() {
                set_tier_nice(&node_b, n)?;
                kb.delete_many(keys)?;
                let mut sum = 0.0;
                for c in keys.chunks(batch) {
                    sum += lookup(&kb, c, false)?;
                }
                sweep_s[si].push(sum);
            }
            if a.nice_sweep {
                set_tier_nice(&node_b, i32::from(kachedb_daemon::remote::DEFAULT_WORKER_NICE))?;
            }
            kb.delete_many(keys)?;
            kbk.delete_many(keys)?;
            let mut sums = [0.0f64; 2];
            for (i, c) in keys.chunks(batch).enumerate() {
                let order = if (i + round) % 2 == 0 { [0, 1] } else { [1, 0] };
                for which in order {
                    sums[which] += lookup(if which == 1 { &kbk } else { &kb }, c, which == 1)?;
                }
            }
            pair_s[0].push(sums[0]);
            pair_s[1].push(sums[1]);
            ratio.push(sums[0] / sums[1]);
            let t = Instant::now();
            let got = plain_get(&rt, &conn, &ns, &batches)?;
            plain_s.push(t.elapsed().as_secs_f64());
            if got < (keys.len() * len) as u64 {
                return Err("the plain client read fewer bytes than stored".into());
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let p = median(&mut plain_s);
        let bytes = (keys.len() * len) as f64;
        let rows = sweep
            .iter()
            .zip(sweep_s.iter_mut())
            .map(|(&n, s)| (false, Some(n), median(s)))
            .chain([(false, None, median(&mut pair_s[0])), (true, None, median(&mut pair_s[1]))]);
        for (mac, tier, f) in rows {
            let tier_label = tier.map(|n| format!(", tier nice {n}")).unwrap_or_default();
            let mac_label = if mac { "MAC on " } else { "MAC off" };
            emit(
                json!({"bench":"remote_fill","block":name,"blocks":keys.len(),"keys_per_lookup":batch,"tier_nice":tier,"mac":mac,
                       "fill_gb_per_s":bytes/f/1e9,"plain_get_gb_per_s":bytes/p/1e9,"fill_vs_plain":p/f,"rounds":rounds}),
                format!(
                    "fill {name:>6} x {:>5}   {:>6.3} GB/s {mac_label} vs plain client GET {:>6.3} GB/s ({:.0} %), median of {rounds}{tier_label}",
                    keys.len(),
                    bytes / f / 1e9,
                    bytes / p / 1e9,
                    p / f * 100.0
                ),
            );
        }
        let r = median(&mut ratio);
        emit(
            json!({"bench":"remote_fill_mac_ratio","block":name,"mac_on_vs_off":r,"rounds":rounds,
                   "ratios":ratio}),
            format!(
                "fill {name:>6} with the MAC: {:.0} % of the fill without, median of {rounds} rounds of paired batches (goal >= 90 %)",
                r * 100.0
            ),
        );
    }
    // The keyed pair is not needed past here (local GETs are timed on B).
    drop((kak, kbk));
    drop((node_ak, node_bk));

    walk(a, &url, &ns, &ka, &node_a, &rt, &conn, &emit)?;

    // Local GET round trip on B: windows of idle and of fills (another client
    // keeps filling), alternated, each condition's percentiles the median over
    // its windows.
    let local = Key::from_bytes(b"rb/local");
    kb.put(local, &[1u8; 4096])?;
    let iters = if a.quick { 10_000 } else { 50_000 };
    let windows = if a.quick { 3 } else { 5 };
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
    // The filler: mode 0 paused (blocked on the condvar, `paused` set), 1 filling, 2 stop.
    let control = Arc::new((Mutex::new(0u8), Condvar::new()));
    let paused = Arc::new(AtomicBool::new(false));
    let mode_is = |c: &(Mutex<u8>, Condvar)| *c.0.lock().unwrap_or_else(|e| e.into_inner());
    let set_mode = |c: &(Mutex<u8>, Condvar), m: u8| {
        *c.0.lock().unwrap_or_else(|e| e.into_inner()) = m;
        c.1.notify_all();
    };
    let filler = {
        let (control, paused, sock, keys) =
            (control.clone(), paused.clone(), node_b.socket().to_path_buf(), small.clone());
        std::thread::spawn(move || {
            let Ok(c) = Client::connect(&ConnectOptions { socket: Some(sock), ..Default::default() }) else { return };
            loop {
                {
                    let mut m = control.0.lock().unwrap_or_else(|e| e.into_inner());
                    while *m == 0 {
                        paused.store(true, Ordering::Release);
                        m = control.1.wait(m).unwrap_or_else(|e| e.into_inner());
                    }
                    if *m == 2 {
                        return;
                    }
                }
                paused.store(false, Ordering::Release);
                for ch in keys.chunks(64) {
                    if mode_is(&control) != 1 {
                        break;
                    }
                    let _ = c.delete_many(ch);
                    let _ = c.lookup(ch);
                }
            }
        })
    };
    // Conditions: (label, nice of B's tier threads, nice of the redis-servers);
    // `None`: left as started.
    let redis_pids: Vec<u32> = cluster.as_ref().map(|c| c.procs.iter().map(Child::id).collect()).unwrap_or_default();
    let mut conditions: Vec<(&str, Option<i32>, Option<i32>)> = vec![("fills", None, None)];
    if a.nice_sweep && redis_pids.is_empty() {
        // A cluster it did not start (`--remote`): its servers are left alone.
        conditions = vec![
            ("fills, tier nice 0", Some(0), None),
            ("fills, tier nice 10", Some(10), None),
            ("fills, tier nice 19", Some(19), None),
        ];
    } else if a.nice_sweep {
        conditions = vec![
            ("fills, tier nice 0, redis nice 0", Some(0), Some(0)),
            ("fills, tier nice 10, redis nice 0", Some(10), Some(0)),
            ("fills, tier nice 19, redis nice 0", Some(19), Some(0)),
            ("fills, tier nice 0, redis nice 19", Some(0), Some(19)),
            ("fills, tier nice 10, redis nice 19", Some(10), Some(19)),
            ("fills, tier nice 19, redis nice 19", Some(19), Some(19)),
        ];
    }
    let mut idle_p: Vec<(u64, u64)> = Vec::new();
    let mut busy_p: Vec<Vec<(u64, u64)>> = vec![Vec::new(); conditions.len()];
    let mut fills = vec![0u64; conditions.len()];
    for _ in 0..windows {
        paused.store(false, Ordering::Release);
        set_mode(&control, 0);
        while !paused.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let v = time_gets(iters)?;
        idle_p.push((percentile(&v, 0.5), percentile(&v, 0.99)));
        for (i, &(_, tier_nice, redis_nice)) in conditions.iter().enumerate() {
            if let Some(n) = tier_nice {
                if renice(node_b.pid(), Some(kachedb_daemon::remote::THREAD_NAME), n) == 0 {
                    return Err(format!(
                        "--nice-sweep: could not set node B's tier threads to nice {n} (needs root or CAP_SYS_NICE)"
                    )
                    .into());
                }
            }
            if let Some(n) = redis_nice {
                for &p in &redis_pids {
                    if renice(p, None, n) == 0 {
                        return Err(format!("--nice-sweep: could not set redis-server {p} to nice {n}").into());
                    }
                }
            }
            set_mode(&control, 1);
            std::thread::sleep(Duration::from_millis(100));
            let before = RemoteStats::of(&stats(&node_b)?).remote_fills;
            let v = time_gets(iters)?;
            fills[i] += RemoteStats::of(&stats(&node_b)?).remote_fills - before;
            busy_p[i].push((percentile(&v, 0.5), percentile(&v, 0.99)));
        }
    }
    set_mode(&control, 2);
    let _ = filler.join();
    let med = |v: &[(u64, u64)]| {
        let (mut a, mut b): (Vec<u64>, Vec<u64>) = v.iter().copied().unzip();
        a.sort_unstable();
        b.sort_unstable();
        (a[a.len() / 2], b[b.len() / 2])
    };
    let (i50, i99) = med(&idle_p);
    for (i, &(label, tier_nice, redis_nice)) in conditions.iter().enumerate() {
        let (b50, b99) = med(&busy_p[i]);
        emit(
            json!({"bench":"remote_local_get_during_fills","condition":label,"tier_nice":tier_nice,"redis_nice":redis_nice,
                   "iters":iters,"windows":windows,"idle_p50_ns":i50,"idle_p99_ns":i99,"busy_p50_ns":b50,"busy_p99_ns":b99,
                   "busy_vs_idle_p50":b50 as f64/i50.max(1) as f64,"fills_meanwhile":fills[i]}),
            format!(
                "local GET on B          p50 {i50} ns / p99 {i99} ns idle; p50 {b50} ns / p99 {b99} ns during {label} ({} fills), median of {windows} windows of {iters}",
                fills[i]
            ),
        );
    }
    let rb = RemoteStats::of(&stats(&node_b)?);
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

/// The chain walk (see the module docs): node A puts the chains, nodes B
/// and B0 walk them against the plain client.
#[allow(clippy::too_many_arguments)]
fn walk(
    a: &RemoteArgs,
    url: &str,
    ns: &str,
    ka: &Client,
    node_a: &DaemonProcess,
    rt: &tokio::runtime::Runtime,
    conn: &redis::cluster_async::ClusterConnection,
    emit: &dyn Fn(serde_json::Value, String),
) -> Result<(), Box<dyn std::error::Error>> {
    let (chains, per_chain, block, rounds) =
        if a.quick { (2usize, 20usize, 1usize << 20, 3usize) } else { (8, 20, 1 << 20, 5) };
    let keys: Vec<Vec<Key>> = (0..chains)
        .map(|c| (0..per_chain).map(|i| Key::from_bytes(format!("rb/walk/{c}/{i}").as_bytes())).collect())
        .collect();
    let data: Vec<u8> = (0..block).map(|i| (i % 241) as u8).collect();
    for chain in &keys {
        let mut parent = None;
        for k in chain {
            ka.put(*k, kachedb_client::Value::bytes(&data).parent(parent))?;
            parent = Some(*k);
        }
    }
    wait_for_writes(node_a)?;
    let slab = (chains * per_chain * block) as u64 + (64 << 20);
    let opts = ["--remote", url, "--remote-namespace", ns];
    let node_ra = DaemonProcess::spawn(slab, &opts)?;
    let node_0 = DaemonProcess::spawn(slab, &[&opts[..], &["--remote-read-ahead", "0"]].concat())?;
    let (kra, k0) = (client(&node_ra)?, client(&node_0)?);
    let all: Vec<Key> = keys.iter().flatten().copied().collect();
    let chunks = format::chunk_count(block as u64, format::DEFAULT_CHUNK_BYTES).unwrap_or(1);
    let walk_node = |kn: &Client| -> Result<f64, Box<dyn std::error::Error>> {
        kn.delete_many(&all)?;
        let t = Instant::now();
        for k in &all {
            let v = kn.get(*k)?.ok_or("a block of the walk was not found")?;
            if v.len() != block {
                return Err("a block of the walk has the wrong length".into());
            }
        }
        Ok(t.elapsed().as_secs_f64())
    };
    let walk_plain = || -> Result<f64, Box<dyn std::error::Error>> {
        let t = Instant::now();
        let bytes = rt.block_on(async {
            let mut bytes = 0u64;
            for k in &all {
                for i in 0..chunks {
                    let mut c = conn.clone();
                    let v: Option<Vec<u8>> =
                        redis::cmd("GET").arg(format::chunk_key(ns, k.0, i)).query_async(&mut c).await?;
                    bytes += v.map_or(0, |v| v.len() as u64);
                }
            }
            Ok::<u64, redis::RedisError>(bytes)
        })?;
        if bytes < (all.len() * block) as u64 {
            return Err("the plain client read fewer bytes than stored".into());
        }
        Ok(t.elapsed().as_secs_f64())
    };
    let mut times: [Vec<f64>; 3] = Default::default();
    for round in 0..rounds {
        for j in 0..3 {
            let which = (round + j) % 3;
            times[which].push(match which {
                0 => walk_node(&kra)?,
                1 => walk_node(&k0)?,
                _ => walk_plain()?,
            });
        }
    }
    let ahead = RemoteStats::of(&stats(&node_ra)?).remote_read_ahead;
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let [mut t_ra, mut t_0, mut t_plain] = times;
    let (ra, off, plain) = (med(&mut t_ra), med(&mut t_0), med(&mut t_plain));
    let bytes = (all.len() * block) as f64;
    emit(
        json!({"bench":"remote_walk","chains":chains,"blocks_per_chain":per_chain,"block_bytes":block,"rounds":rounds,
               "read_ahead_gb_per_s":bytes/ra/1e9,"no_read_ahead_gb_per_s":bytes/off/1e9,"plain_gb_per_s":bytes/plain/1e9,
               "read_ahead_vs_plain":plain/ra,"no_read_ahead_vs_plain":plain/off,"blocks_read_ahead":ahead}),
        format!(
            "walk {chains} x {per_chain} x 1MiB, GET after GET: read-ahead 8 {:.3} GB/s ({:.2}x the plain client), off {:.3} GB/s ({:.2}x), plain client block after block {:.3} GB/s; median of {rounds} ({ahead} blocks read ahead)",
            bytes / ra / 1e9,
            plain / ra,
            bytes / off / 1e9,
            plain / off,
            bytes / plain / 1e9
        ),
    );
    Ok(())
}

/// Sets the nice value of the threads of process `pid` (those named `name`,
/// or all); how many were set.
fn renice(pid: u32, name: Option<&str>, nice: i32) -> usize {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    let mut n = 0;
    for t in tasks.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if name.is_some_and(|want| comm.trim_end() != want) {
            continue;
        }
        let Some(tid) =
            t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()).and_then(rustix::process::Pid::from_raw)
        else {
            continue;
        };
        if rustix::process::setpriority_process(Some(tid), nice).is_ok() {
            n += 1;
        }
    }
    n
}

fn wait_for_writes(d: &DaemonProcess) -> Result<(), Box<dyn std::error::Error>> {
    let t = Instant::now();
    loop {
        let r = RemoteStats::of(&stats(d)?);
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
