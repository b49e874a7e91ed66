//! How the blocks of one `get_prefix` become torch tensors with few torch
//! calls: the plan, pure arithmetic over addresses, lengths, dtypes and shapes.
//!
//! * A **group** is a stretch of the region exported as one DLPack tensor
//!   (one torch storage) whose owner holds the pins of exactly the blocks in
//!   it. Blocks go to the same group while, in address order, each starts at
//!   most [`MAX_GAP_BYTES`] past the end of the ones before it; a block whose
//!   offset in its group is not a multiple of its itemsize gets a group of its
//!   own (a typed view of the group's bytes could not start there).
//! * A **run** is a sequence of blocks, consecutive in the caller's order, in
//!   one group, of one dtype and shape, each the same number of elements
//!   (`pitch`, >= 0) after the one before: one `as_strided` of the group's
//!   typed tensor and one `unbind` make all its views.
//!
//! Every view is made from its own group's storage, so a view and every tensor
//! derived from it hold that group's pins, its own block's among them.

/// Largest hole between two blocks of one group, in bytes. The hole is mapped
/// (it is region memory) but belongs to other blocks; no view made here reads
/// it. Past this gap a new group starts, so one storage never spans the region.
pub(crate) const MAX_GAP_BYTES: usize = 1 << 20;

/// What the plan needs of one block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BlockSpec {
    /// Address of the first byte in this process.
    pub addr: usize,
    /// Bytes.
    pub len: usize,
    /// Protocol dtype code.
    pub code: u8,
    /// Bytes per element (1, 2, 4 or 8).
    pub itemsize: usize,
    /// Shape.
    pub dims: Vec<u64>,
}

/// One exported stretch of the region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Group {
    /// Address of its first byte (the lowest block address in it).
    pub start_addr: usize,
    /// Bytes, to the end of its last-ending block.
    pub len: usize,
    /// Indices (in the caller's order) of its blocks, ascending.
    pub members: Vec<usize>,
}

/// Views made by one `as_strided` (and, for more than one, one `unbind`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Run {
    /// Index of its group.
    pub group: usize,
    /// Index (caller's order) of its first block; the run's blocks are
    /// `first .. first + count`.
    pub first: usize,
    pub count: usize,
    /// Offset of the first block in its group, in elements of its dtype.
    pub offset_elems: usize,
    /// Elements from one block's start to the next's (0 for a run of one).
    pub pitch_elems: usize,
}

/// The groups and the runs (in the caller's order, covering every block once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    pub groups: Vec<Group>,
    pub runs: Vec<Run>,
}

/// The plan for `blocks` (any order, repeats allowed; itemsizes non-zero).
pub(crate) fn plan(blocks: &[BlockSpec]) -> Plan {
    let mut order: Vec<usize> = (0..blocks.len()).collect();
    order.sort_by_key(|&i| blocks[i].addr);
    let mut groups: Vec<Group> = Vec::new();
    // Of each block: its group and its offset there in elements.
    let mut placed: Vec<(usize, usize)> = vec![(0, 0); blocks.len()];
    // The group being grown in the address sweep.
    let mut open: Option<usize> = None;
    for &i in &order {
        let b = &blocks[i];
        let fits = open.filter(|&g| {
            let grp = &groups[g];
            let end = grp.start_addr + grp.len;
            b.addr <= end.saturating_add(MAX_GAP_BYTES) && (b.addr - grp.start_addr).is_multiple_of(b.itemsize)
        });
        let g = match fits {
            Some(g) => g,
            None => {
                groups.push(Group { start_addr: b.addr, len: 0, members: Vec::new() });
                let g = groups.len() - 1;
                // A misaligned block's group stays closed to the blocks after
                // it; the open one goes on.
                let aligned_miss = open.is_some_and(|o| {
                    let grp = &groups[o];
                    b.addr <= (grp.start_addr + grp.len).saturating_add(MAX_GAP_BYTES)
                });
                if !aligned_miss {
                    open = Some(g);
                }
                g
            }
        };
        let grp = &mut groups[g];
        grp.len = grp.len.max(b.addr - grp.start_addr + b.len);
        grp.members.push(i);
        placed[i] = (g, (b.addr - grp.start_addr) / b.itemsize);
    }
    for grp in &mut groups {
        grp.members.sort_unstable();
    }
    let mut runs: Vec<Run> = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        let (g, off) = placed[i];
        if let Some(r) = runs.last_mut() {
            let prev = &blocks[r.first + r.count - 1];
            let (prev_g, prev_off) = placed[r.first + r.count - 1];
            let same = prev_g == g && prev.code == b.code && prev.dims == b.dims;
            if same && off >= prev_off {
                let step = off - prev_off;
                if r.count == 1 || step == r.pitch_elems {
                    r.pitch_elems = step;
                    r.count += 1;
                    continue;
                }
            }
        }
        runs.push(Run { group: g, first: i, count: 1, offset_elems: off, pitch_elems: 0 });
    }
    Plan { groups, runs }
}

/// Row-major strides, in elements, of a compact tensor of shape `dims`.
pub(crate) fn contiguous_strides(dims: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(dims[i + 1].max(1));
    }
    strides
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(addr: usize, len: usize, code: u8, itemsize: usize, dims: &[u64]) -> BlockSpec {
        BlockSpec { addr, len, code, itemsize, dims: dims.to_vec() }
    }

    #[test]
    fn evenly_spaced_blocks_are_one_group_and_one_run() {
        let blocks: Vec<_> = (0..128).map(|i| b(4096 + i * 69632, 65536, 5, 2, &[32768])).collect();
        let p = plan(&blocks);
        assert_eq!(p.groups.len(), 1);
        assert_eq!(p.groups[0].start_addr, 4096);
        assert_eq!(p.groups[0].len, 127 * 69632 + 65536);
        assert_eq!(p.groups[0].members, (0..128).collect::<Vec<_>>());
        assert_eq!(p.runs, vec![Run { group: 0, first: 0, count: 128, offset_elems: 0, pitch_elems: 69632 / 2 }]);
    }

    #[test]
    fn far_apart_blocks_get_groups_of_their_own() {
        let far = 4096 + 192 + MAX_GAP_BYTES + 1; // past the gap after the block at 4096 + 128
        let blocks = vec![b(4096, 64, 1, 1, &[64]), b(far, 64, 1, 1, &[64]), b(4096 + 128, 64, 1, 1, &[64])];
        let p = plan(&blocks);
        assert_eq!(p.groups.len(), 2);
        assert_eq!(p.groups[0].members, vec![0, 2]);
        assert_eq!(p.groups[1].members, vec![1]);
        // Block 1 is in another group: three runs of one.
        assert_eq!(p.runs.len(), 3);
        assert_eq!((p.runs[2].group, p.runs[2].offset_elems), (0, 128));
    }

    #[test]
    fn a_misaligned_block_is_exported_alone_and_the_group_goes_on() {
        // f32 (itemsize 4) at offset 2 from the group start; the next u8 block joins group 0.
        let blocks = vec![b(1000, 16, 1, 1, &[16]), b(1002, 8, 3, 4, &[2]), b(1032, 16, 1, 1, &[16])];
        let p = plan(&blocks);
        assert_eq!(p.groups.len(), 2);
        assert_eq!(p.groups[0].members, vec![0, 2]);
        assert_eq!((p.groups[1].start_addr, p.groups[1].len, p.groups[1].members.clone()), (1002, 8, vec![1]));
        assert_eq!(
            p.runs.iter().map(|r| (r.group, r.first, r.count)).collect::<Vec<_>>(),
            [(0, 0, 1), (1, 1, 1), (0, 2, 1)]
        );
    }

    #[test]
    fn runs_break_at_a_new_shape_dtype_or_pitch_and_never_go_backwards() {
        let blocks = vec![
            b(0, 8, 3, 4, &[2]),
            b(64, 8, 3, 4, &[2]),
            b(128, 8, 3, 4, &[2]),
            b(256, 8, 3, 4, &[2]),    // other pitch
            b(320, 8, 3, 4, &[1, 2]), // other shape
            b(384, 8, 1, 1, &[8]),    // other dtype
            b(0, 8, 1, 1, &[8]),      // backwards
            b(0, 8, 1, 1, &[8]),      // the same block again: pitch 0
        ];
        let p = plan(&blocks);
        assert_eq!(p.groups.len(), 1);
        let runs: Vec<_> = p.runs.iter().map(|r| (r.first, r.count, r.offset_elems, r.pitch_elems)).collect();
        assert_eq!(runs, [(0, 3, 0, 16), (3, 1, 64, 0), (4, 1, 80, 0), (5, 1, 384, 0), (6, 2, 0, 0)]);
    }

    #[test]
    fn every_block_lies_inside_its_group_at_its_offset() {
        let blocks = vec![b(300, 0, 1, 1, &[0]), b(100, 40, 4, 8, &[5]), b(96, 8, 3, 4, &[2]), b(500, 3, 1, 1, &[3])];
        let p = plan(&blocks);
        let mut seen = [false; 4];
        for r in &p.runs {
            let grp = &p.groups[r.group];
            for k in 0..r.count {
                let i = r.first + k;
                let bl = &blocks[i];
                let at = grp.start_addr + (r.offset_elems + k * r.pitch_elems) * bl.itemsize;
                assert_eq!(at, bl.addr, "block {i}");
                assert!(bl.addr + bl.len <= grp.start_addr + grp.len);
                assert!(grp.members.contains(&i));
                seen[i] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn strides_are_row_major() {
        assert_eq!(contiguous_strides(&[]), Vec::<u64>::new());
        assert_eq!(contiguous_strides(&[7]), vec![1]);
        assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
    }
}
