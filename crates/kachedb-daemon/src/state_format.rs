//! The takeover state's formats, pinned: a state written by a build of
//! each format this build reads is committed
//! (`tests/fixtures/takeover-state-v5.bin`, `…-v6.bin`) and must decode
//! ([`crate::takeover::decode_serve`], [`crate::takeover::decode_control`])
//! and restore into the store it was made from, so a change to the format
//! fails here until [`crate::takeover::STATE_VERSION`] is bumped and a
//! decoder of the previous format is kept in `takeover/` (N-1 → N).
//! `docs/takeover.md` ("The state format") describes the encoding field by field.

#[cfg(test)]
mod tests {
    use crate::store::{EvictionPolicy, SessionId, Store};
    use crate::takeover::state::{self, ChannelState, ParkedWait, RegionLayout, ServeCounters, ServeState, TierWrite};
    use crate::takeover::ConnState;
    use crate::takeover::{self, decode_control, decode_serve, ControlState, STATE_VERSIONS_READ};
    use kachedb_shm::{DType, Request, Shape, Status};

    const SLAB_OFFSET: u64 = 4096;
    const SLAB_LEN: u64 = 64 * 4096;

    /// The committed state of format `version` (`KDB_WRITE_STATE_FIXTURE=1`
    /// rewrites the current format's, from a build that writes it): a `u32`
    /// little-endian length of the serve loop's part, that part, then the
    /// control thread's.
    fn fixture_path(version: u32) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(format!("takeover-state-v{version}.bin"))
    }

    fn reserve(st: &mut Store, s: SessionId, key: u128, len: u64) -> u64 {
        let shape = Shape::for_bytes(len).unwrap();
        let c = st.handle(s, 1, &Request::Reserve { key, dtype: DType::U8, shape, len, page_offset: 0 });
        assert_eq!(c.status, Status::Ok);
        c.handle
    }

    /// The store the fixtures hold: ten chained blocks, a pin on key 5, an
    /// open reservation of key 99; and the two sessions.
    fn store() -> (Store, SessionId, SessionId, u64, u64) {
        let mut a = Store::new(SLAB_OFFSET, SLAB_LEN);
        a.set_eviction_policy(EvictionPolicy::Chain);
        let (s1, s2) = (a.open_session(), a.open_session());
        for k in 1..=10u128 {
            let h = reserve(&mut a, s1, k, 4096 * 2);
            let parent = (k > 1).then_some(k - 1);
            assert_eq!(a.handle(s1, 2, &Request::Commit { handle: h, parent }).status, Status::Ok);
        }
        let pin = a.handle(s2, 3, &Request::Get { key: 5 });
        assert_eq!(pin.status, Status::Ok);
        let open = reserve(&mut a, s2, 99, 4096);
        (a, s1, s2, pin.handle, open)
    }

    fn layout() -> RegionLayout {
        RegionLayout {
            channel_count: 8,
            ring_capacity: 64,
            channel_offset: 4096,
            channel_stride: 8192,
            slab_offset: SLAB_OFFSET,
            slab_len: SLAB_LEN,
            region_len: SLAB_OFFSET + SLAB_LEN,
        }
    }

    fn control() -> ControlState {
        ControlState {
            free_channels: vec![2, 3],
            quarantine: vec![(4, 1234)],
            conns: vec![
                ConnState {
                    channel: Some(0),
                    pid: 100,
                    uid: 1000,
                    refused: false,
                    awaiting_first: false,
                    unread: vec![],
                },
                ConnState {
                    channel: Some(1),
                    pid: 101,
                    uid: 1001,
                    refused: false,
                    awaiting_first: true,
                    unread: b"{\"op\":".to_vec(),
                },
            ],
        }
    }

    /// The fixture's state in the format this build writes.
    fn encoded_now() -> Vec<u8> {
        let (store, s1, s2, _, _) = store();
        let frame = vec![7u8; 64];
        let st = ServeState {
            region_generation: 7,
            layout: layout(),
            store: store.to_state(),
            channels: vec![
                ChannelState {
                    channel: 0,
                    session: s1.as_u64(),
                    pid: 100,
                    uid: 1000,
                    backlog: vec![frame.clone()],
                    held: vec![],
                    waiting: false,
                    kicked: false,
                    tier_asked: vec![],
                },
                ChannelState {
                    channel: 1,
                    session: s2.as_u64(),
                    pid: 101,
                    uid: 1001,
                    backlog: vec![],
                    held: vec![frame],
                    waiting: true,
                    kicked: false,
                    tier_asked: vec![42],
                },
            ],
            waits: vec![ParkedWait { channel: 1, key: 42, request_id: 3, left_ms: Some(1500) }],
            counters: ServeCounters { figures: [21, 0, 2, 2, 0, 0, 0] },
            uptime_ms: 12_345,
            tier_writes: vec![TierWrite { key: 10, parent: Some(9) }],
            tier_unremoved: vec![77],
            tier_fds: vec![("disk".into(), 2)],
        };
        let serve = state::encode(&st).unwrap();
        let control = takeover::encode(&control()).unwrap();
        let mut out = (serve.len() as u32).to_le_bytes().to_vec();
        out.extend(serve);
        out.extend(control);
        out
    }

    /// The committed state of format `version` is read by this build into
    /// the same store: same blocks, chains, pins and reservations (the same
    /// handles work), sessions, waits, counters and tier work.
    fn the_committed_state_restores(version: u32) {
        let path = fixture_path(version);
        if std::env::var_os("KDB_WRITE_STATE_FIXTURE").is_some() && version == takeover::STATE_VERSION {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, encoded_now()).unwrap();
        }
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let n = u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize;
        let (serve, control_bytes) = bytes[4..].split_at(n);
        let serve = decode_serve(version, serve)
            .unwrap_or_else(|e| panic!("format {version} no longer decodes ({e}): keep a decoder of it (module docs)"));
        let ctl = decode_control(version, control_bytes).expect("the control state no longer decodes");

        assert_eq!(serve.region_generation, 7);
        assert_eq!(serve.layout, layout());
        assert_eq!(serve.uptime_ms, 12_345);
        assert_eq!(serve.counters.to_stats().ops, 21);
        assert_eq!(serve.counters.to_stats().clients_total, 2);
        assert_eq!(serve.tier_writes, vec![TierWrite { key: 10, parent: Some(9) }]);
        assert_eq!(serve.tier_unremoved, vec![77]);
        assert_eq!(serve.tier_fds, vec![("disk".to_string(), 2)]);
        assert_eq!(serve.waits, vec![ParkedWait { channel: 1, key: 42, request_id: 3, left_ms: Some(1500) }]);
        assert_eq!(serve.channels.len(), 2);
        assert_eq!(serve.channels[0].backlog, vec![vec![7u8; 64]]);
        assert_eq!(serve.channels[1].held, vec![vec![7u8; 64]]);
        assert!(serve.channels[1].waiting && serve.channels[1].tier_asked == vec![42]);
        assert_eq!((ctl.free_channels, ctl.quarantine), (vec![2, 3], vec![(4, 1234)]));
        assert_eq!(ctl.conns.len(), 2);
        assert_eq!(ctl.conns[1].unread, b"{\"op\":".to_vec());

        // The store answers as the one it was made from.
        let (mut a, s1, s2, pin, open) = store();
        assert_eq!((serve.channels[0].session, serve.channels[1].session), (s1.as_u64(), s2.as_u64()));
        let mut b = Store::from_state(serve.store, SLAB_OFFSET, SLAB_LEN).unwrap();
        for k in [1u128, 5, 10, 99] {
            assert_eq!(a.peek(k), b.peek(k), "key {k}");
        }
        let script = [
            (s2, Request::Release { handle: pin }),
            (s2, Request::Commit { handle: open, parent: Some(10) }),
            (
                s1,
                Request::Reserve {
                    key: 50,
                    dtype: DType::U8,
                    shape: Shape::for_bytes(40 * 4096).unwrap(),
                    len: 40 * 4096,
                    page_offset: 0,
                },
            ),
            (s1, Request::Lookup { key: 1 }),
            (s1, Request::Get { key: 99 }),
            (s2, Request::Release { handle: pin }),
        ];
        for (s, r) in &script {
            let (x, y) = (a.handle(*s, 7, r), b.handle(*s, 7, r));
            assert_eq!((x.status, x.handle, x.offset), (y.status, y.handle, y.offset), "{r:?}");
        }
        b.check_invariants().unwrap();
    }

    /// A daemon of format 5 (the format before this build's) is taken over:
    /// its committed state restores.
    #[test]
    fn the_committed_state_of_format_5_restores_into_the_store_it_was_made_from() {
        the_committed_state_restores(5);
    }

    /// The committed state of format 6 restores, and this build still writes
    /// exactly those bytes: a change to the format fails here.
    #[test]
    fn the_committed_state_of_format_6_restores_and_is_what_this_build_writes() {
        the_committed_state_restores(6);
        assert_eq!(takeover::STATE_VERSION, 6, "a new format: commit its fixture, keep this one's decoder");
        let committed = std::fs::read(fixture_path(6)).unwrap();
        assert!(committed == encoded_now(), "format 6 is no longer what this build writes: bump STATE_VERSION");
    }

    /// A format this build does not read is an error naming the formats it reads.
    #[test]
    fn a_format_not_read_is_refused_by_name() {
        let bytes = encoded_now();
        for v in [0, 4, takeover::STATE_VERSION + 1, 999] {
            if STATE_VERSIONS_READ.contains(&v) {
                continue;
            }
            let e = decode_serve(v, &bytes[4..]).expect_err("refused");
            assert!(e.contains(&format!("state format {v} is not one this build reads")), "{e}");
            assert!(decode_control(v, &bytes).is_err());
        }
        assert_eq!(STATE_VERSIONS_READ.last(), Some(&takeover::STATE_VERSION));
    }
}
