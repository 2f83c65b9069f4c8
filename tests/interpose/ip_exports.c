/* Interpose test: the symbols libvmmhook.so exports are exactly the hooked symbols of
 * src/interpose/hooked.h (the one list) among the driver's names, and each of them is what the
 * dynamic loader finds first when the library is preloaded.
 *
 * The exported set is read from the library file's dynamic symbol table (ELF .dynsym: defined,
 * global or weak, default visibility), so a symbol the version script (src/vmmhook.map) or a
 * missing alias leaves out fails here, and so does a cu* export the list does not name.
 *
 * argv[1]: the path of libvmmhook.so.
 */
#include <elf.h>
#include <fcntl.h>
#include <sys/stat.h>

#include "hooked.h"
#include "ip_common.h"

#define NAME(sym, pfn, base, since, until, stream) #sym,
static const char *const hooked[] = {VMH_HOOKED(NAME)};
#undef NAME
#define NHOOKED (sizeof hooked / sizeof hooked[0])

#define ROW(sym, pfn, base, since, until, stream) {#sym, base, since, until, stream},
static const struct row {
    const char *name, *base;
    int since, until;
    enum ip_stream_kind stream;
} rows[] = {VMH_HOOKED(ROW)};
#undef ROW

/* The table answers every (base, version, stream flavour) with at most one row: ranges of one
 * base and flavour do not overlap, each is non-empty, a legacy row has its per-thread twin
 * with the same range, and every name starts with its base. */
static size_t table_mistakes(void)
{
    size_t bad = 0;
    for (size_t i = 0; i < NHOOKED; i++) {
        const struct row *a = &rows[i];
        if (a->since >= a->until || strncmp(a->name, a->base, strlen(a->base)) != 0) {
            printf("     row %s: empty range or a name not of its base %s\n", a->name, a->base);
            bad++;
        }
        bool twin = a->stream != IP_STREAM_LEGACY;
        for (size_t j = 0; j < NHOOKED; j++) {
            const struct row *b = &rows[j];
            if (j == i || strcmp(a->base, b->base) != 0)
                continue;
            bool same_flavour = a->stream == b->stream || a->stream == IP_STREAM_NONE ||
                                b->stream == IP_STREAM_NONE;
            if (same_flavour && a->since < b->until && b->since < a->until) {
                printf("     rows %s and %s overlap\n", a->name, b->name);
                bad++;
            }
            if (a->stream == IP_STREAM_LEGACY && b->stream == IP_STREAM_PTSZ &&
                a->since == b->since && a->until == b->until)
                twin = true;
        }
        if (!twin) {
            printf("     row %s: no per-thread-stream twin\n", a->name);
            bad++;
        }
    }
    return bad;
}

/* The defined, visible dynamic symbols of an ELF64 file whose names start with "cu". */
static size_t exported_cu(const char *path, const char **names, size_t max)
{
    int fd = open(path, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        perror(path);
        exit(1);
    }
    const unsigned char *f = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (f == MAP_FAILED || memcmp(f, ELFMAG, SELFMAG) != 0 || f[EI_CLASS] != ELFCLASS64) {
        printf("FAIL %s is not an ELF64 file\n", path);
        exit(1);
    }
    const Elf64_Ehdr *eh = (const Elf64_Ehdr *)f;
    const Elf64_Shdr *sh = (const Elf64_Shdr *)(f + eh->e_shoff);
    size_t n = 0;
    for (unsigned i = 0; i < eh->e_shnum; i++) {
        if (sh[i].sh_type != SHT_DYNSYM)
            continue;
        const Elf64_Sym *sym = (const Elf64_Sym *)(f + sh[i].sh_offset);
        const char *strtab = (const char *)(f + sh[sh[i].sh_link].sh_offset);
        size_t count = sh[i].sh_size / sizeof *sym;
        for (size_t k = 0; k < count; k++) {
            const char *name = strtab + sym[k].st_name;
            unsigned bind = ELF64_ST_BIND(sym[k].st_info);
            if (sym[k].st_shndx == SHN_UNDEF || (bind != STB_GLOBAL && bind != STB_WEAK) ||
                ELF64_ST_VISIBILITY(sym[k].st_other) != STV_DEFAULT)
                continue;
            if (strncmp(name, "cu", 2) == 0 && n < max)
                names[n++] = name;
        }
    }
    return n;
}

static bool in_list(const char *name, const char *const *list, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(list[i], name) == 0)
            return true;
    return false;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    ip_require_preloaded();
    if (argc < 2) {
        printf("FAIL usage: ip_exports LIBVMMHOOK_PATH\n");
        return 1;
    }
    static const char *exported[1024];
    size_t nexp = exported_cu(argv[1], exported, sizeof exported / sizeof exported[0]);
    CHECK(NHOOKED > 40 && nexp > 0, "%zu hooked symbols listed, %zu cu* symbols exported", NHOOKED,
          nexp);

    size_t missing = 0, stray = 0, not_first = 0;
    for (size_t i = 0; i < NHOOKED; i++) {
        if (!in_list(hooked[i], exported, nexp)) {
            printf("     hooked but not exported: %s\n", hooked[i]);
            missing++;
        }
        /* Preloaded: the process's first definition is ours. */
        if (!ip_in_hook(dlsym(RTLD_DEFAULT, hooked[i]))) {
            printf("     dlsym(RTLD_DEFAULT, %s) is not the library's\n", hooked[i]);
            not_first++;
        }
    }
    for (size_t i = 0; i < nexp; i++) {
        if (!in_list(exported[i], hooked, NHOOKED)) {
            printf("     exported but not in hooked.h: %s\n", exported[i]);
            stray++;
        }
    }
    size_t mistakes = table_mistakes();
    CHECK(mistakes == 0, "hooked.h answers every lookup with at most one row (%zu mistakes)",
          mistakes);
    CHECK(missing == 0, "every hooked symbol is exported (%zu missing)", missing);
    CHECK(stray == 0, "every exported cu* symbol is a hooked one (%zu others)", stray);
    CHECK(not_first == 0, "every hooked symbol resolves to the library first (%zu not)", not_first);
    CHECK(in_list("cuMemAlloc_v2", exported, nexp) && in_list("cuCtxCreate_v4", exported, nexp) &&
              in_list("cuStreamBeginCapture_v2_ptsz", exported, nexp) &&
              !in_list("cuMemAlloc", exported, nexp),
          "spot checks: cuMemAlloc_v2, cuCtxCreate_v4, cuStreamBeginCapture_v2_ptsz exported; "
          "the v1 cuMemAlloc (not hooked) not");
    return ip_finish("ip_exports");
}
